// The radix tree core: token sequences -> KV page ids, with no Python in it.
//
// Same contract and the same step-by-step behaviour as the Python reference,
// radixserve/scheduler/radix_cache.py (docs/architecture.md): whole-page
// matching, split = a NEW prefix node (the existing node keeps the deeper part
// and its handle stays valid), a logical LRU clock ticked once per
// match_prefix/insert, ties by a creation counter, one root per salt, and a
// min-heap of eviction candidates with lazy deletion. The differential test
// compares the two trees after every operation, so any change here must be
// made there too.
//
// Nodes live in one vector and refer to each other by slot; freed slots are
// reused. A handle is (slot, node_id): ids are never reused, so a handle on an
// evicted node is detected even when its slot holds a new node.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace radixserve {

// Misuse of the tree by the caller (stale handle, unlock below zero, reset
// while locked). The bindings raise it as RadixCacheError.
struct MisuseError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A broken invariant found by check(). The bindings raise it as AssertionError.
struct InvariantError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr int32_t kNoSlot = -1;
constexpr int64_t kRootId = 0;   // every root has id 0, like the Python roots
constexpr int64_t kFreeId = -1;  // an unused slot

struct NodeRef {
  int32_t slot;
  int64_t id;  // kRootId for a root: lock/unlock on it do nothing
};

class RadixTree {
 public:
  explicit RadixTree(int32_t page_size);

  int32_t page_size() const { return page_size_; }
  int64_t evictable_pages() const { return evictable_; }
  int64_t protected_pages() const { return protected_; }
  int64_t num_nodes() const { return num_nodes_; }
  int64_t clock() const { return clock_; }

  // The root of a salt (nullptr: the default namespace). With create=false a
  // missing salt gives kNoSlot.
  int32_t root(const std::string* salt, bool create);

  struct Match {
    int64_t hit_len;  // tokens
    NodeRef last;
  };
  // Longest cached whole-page prefix; splits and stamps like the reference.
  // The hit's pages are then copied out with copy_match_pages (hit_len /
  // page_size of them) before any other call.
  Match match_prefix(const int32_t* tokens, int64_t n, int32_t root);
  void copy_match_pages(int32_t* out) const;
  int64_t peek_prefix(const int32_t* tokens, int64_t n, int32_t root) const;
  // The tokens that follow the whole of tokens[0:n] on a cached path (at most
  // max_len, into `out`): the rest of the edge where the sequence ends, then down
  // the most recently used child (last_access, then the newer id) at every node.
  // Empty when tokens[0:n] is not a cached path. A last partial page is matched
  // against the children's first tokens. Changes nothing (no split, no stamp).
  void continuation(const int32_t* tokens, int64_t n, int32_t root, int64_t max_len,
                    std::vector<int32_t>& out) const;

  // pages holds exactly n / page_size ids (checked by the caller).
  Match insert(const int32_t* tokens, int64_t n, const int32_t* pages, int32_t root);

  void lock(NodeRef ref);
  void unlock(NodeRef ref);

  // Frees unlocked leaves LRU first; their pages are appended to `victims`
  // in eviction order (the caller hands them to the allocator).
  int64_t evict(int64_t num_pages, std::vector<int32_t>& victims);
  // Empties an idle tree; every page goes to `pages` in ascending order.
  void reset(std::vector<int32_t>& pages);

  void all_pages(std::vector<int32_t>& out) const;

  // A read-only copy of the tree's shape (explain and the dashboard read it;
  // radix_cache.py's export_nodes is the twin). Nodes breadth first from the
  // roots (the default namespace first, then salts in byte order), children by
  // id; per node its parent's index (-1: under a root), namespace index, id,
  // last_access, lock_ref, edge length, and the first max_label tokens of its
  // edge (all of them when max_label < 0). only_salt: one namespace (nullptr:
  // the default) instead of every one.
  struct Export {
    std::vector<std::pair<bool, std::string>> salts;  // (has a salt, the salt)
    std::vector<int32_t> parent, ns, lock_ref, labels;
    std::vector<int64_t> id, last_access, num_tokens, label_offsets;
  };
  void export_nodes(int64_t max_label, bool every_namespace, const std::string* only_salt,
                    Export& out) const;

  struct NodeInfo {
    bool attached;
    int32_t lock_ref;
    int64_t last_access;
    int64_t num_tokens;
  };
  NodeInfo info(NodeRef ref) const;  // roots: attached, all zero
  void check() const;  // throws InvariantError
  std::string describe(NodeRef ref) const;

 private:
  struct Node {
    std::vector<int32_t> key;    // the edge's tokens
    std::vector<int32_t> pages;  // key.size() / page_size ids
    // Children by first token -> head of a chain linked through next_sibling.
    // With page_size > 1 siblings may share a first token (their first pages
    // differ); with page_size 1 every chain has one node.
    std::unordered_map<int32_t, int32_t> children;
    int64_t id = kFreeId;
    int64_t last_access = 0;
    int32_t parent = kNoSlot;
    int32_t next_sibling = kNoSlot;
    int32_t lock_ref = 0;
    int32_t num_children = 0;
    bool has_salt = false;  // roots only
    std::string salt;       // roots only
  };
  struct HeapEntry {
    int64_t last_access;
    int64_t id;
    int32_t slot;
    // std heap functions build a max-heap: invert to pop the oldest first.
    bool operator<(const HeapEntry& o) const {
      return last_access != o.last_access ? last_access > o.last_access : id > o.id;
    }
  };

  int32_t new_slot();
  void free_slot(int32_t slot);
  bool is_root(int32_t slot) const { return nodes_[slot].id == kRootId; }
  bool is_candidate(int32_t slot) const;
  bool live(NodeRef ref) const;
  bool newer(int32_t a, int32_t b) const;  // a was used after b (continuation's choice)
  int32_t find_child(int32_t node, const int32_t* first_page) const;
  void add_child(int32_t parent, int32_t child);
  void remove_child(int32_t parent, int32_t child);
  int32_t split(int32_t child, int64_t at);
  int64_t common_len(int32_t node, const int32_t* tokens, int64_t avail) const;
  void push_candidate(int32_t slot);
  void compact_heap();
  template <class F>
  void for_each_child(int32_t node, F&& f) const;
  template <class F>
  void for_each_node(F&& f) const;

  int32_t page_size_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_slots_;
  std::unordered_map<std::string, int32_t> salt_roots_;
  std::vector<HeapEntry> heap_;
  std::vector<int32_t> path_;  // the last match's nodes, reused across calls
  int64_t clock_ = 0;
  int64_t next_id_ = 1;
  int64_t num_nodes_ = 0;  // non-root nodes
  int64_t evictable_ = 0;  // pages in unlocked nodes
  int64_t protected_ = 0;  // pages in locked nodes
  static constexpr int32_t kDefaultRoot = 0;
};

}  // namespace radixserve
