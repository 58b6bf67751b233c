// The radix tree core; see radix_tree.h for the contract and why it mirrors
// the Python reference step by step.
#include "radix_tree.h"

#include <algorithm>
#include <cstring>
#include <tuple>
#include <unordered_set>

namespace radixserve {

RadixTree::RadixTree(int32_t page_size) : page_size_(page_size) {
  if (page_size < 1) throw std::invalid_argument("page_size must be >= 1");
  nodes_.emplace_back();  // the default root lives in slot 0 forever
  nodes_[kDefaultRoot].id = kRootId;
}

int32_t RadixTree::new_slot() {
  if (!free_slots_.empty()) {
    int32_t s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }
  nodes_.emplace_back();
  return static_cast<int32_t>(nodes_.size() - 1);
}

void RadixTree::free_slot(int32_t slot) {
  nodes_[slot] = Node();  // releases the edge's memory now, not at reuse
  free_slots_.push_back(slot);
}

int32_t RadixTree::root(const std::string* salt, bool create) {
  if (salt == nullptr) return kDefaultRoot;
  auto it = salt_roots_.find(*salt);
  if (it != salt_roots_.end()) return it->second;
  if (!create) return kNoSlot;
  int32_t s = new_slot();
  nodes_[s].id = kRootId;
  nodes_[s].has_salt = true;
  nodes_[s].salt = *salt;
  salt_roots_.emplace(*salt, s);
  return s;
}

bool RadixTree::is_candidate(int32_t slot) const {
  const Node& n = nodes_[slot];
  return n.id > 0 && n.parent != kNoSlot && n.lock_ref == 0 && n.num_children == 0;
}

bool RadixTree::live(NodeRef ref) const {
  return ref.slot >= 0 && static_cast<size_t>(ref.slot) < nodes_.size() &&
         nodes_[ref.slot].id == ref.id;
}

int32_t RadixTree::find_child(int32_t node, const int32_t* first_page) const {
  const auto& children = nodes_[node].children;
  auto it = children.find(first_page[0]);
  if (it == children.end()) return kNoSlot;
  int32_t c = it->second;
  if (page_size_ == 1) return c;
  const size_t bytes = sizeof(int32_t) * page_size_;
  while (c != kNoSlot && std::memcmp(nodes_[c].key.data(), first_page, bytes) != 0)
    c = nodes_[c].next_sibling;
  return c;
}

void RadixTree::add_child(int32_t parent, int32_t child) {
  Node& p = nodes_[parent];
  auto [it, fresh] = p.children.try_emplace(nodes_[child].key[0], child);
  nodes_[child].next_sibling = fresh ? kNoSlot : it->second;
  it->second = child;
  nodes_[child].parent = parent;
  ++p.num_children;
}

void RadixTree::remove_child(int32_t parent, int32_t child) {
  Node& p = nodes_[parent];
  auto it = p.children.find(nodes_[child].key[0]);
  int32_t next = nodes_[child].next_sibling;
  if (it->second == child) {
    if (next == kNoSlot)
      p.children.erase(it);
    else
      it->second = next;
  } else {
    int32_t c = it->second;
    while (nodes_[c].next_sibling != child) c = nodes_[c].next_sibling;
    nodes_[c].next_sibling = next;
  }
  nodes_[child].next_sibling = kNoSlot;
  nodes_[child].parent = kNoSlot;
  --p.num_children;
}

int64_t RadixTree::common_len(int32_t node, const int32_t* tokens, int64_t avail) const {
  const std::vector<int32_t>& key = nodes_[node].key;
  const int64_t n = std::min<int64_t>(static_cast<int64_t>(key.size()), avail);
  // Whole-edge matches are the common case on a shared path: one memcmp.
  if (std::memcmp(key.data(), tokens, sizeof(int32_t) * n) == 0) return n;
  int64_t i = 0;
  while (key[i] == tokens[i]) ++i;
  return i;
}

int32_t RadixTree::split(int32_t child, int64_t at) {
  const int32_t prefix = new_slot();  // may move nodes_: take references after
  Node& c = nodes_[child];
  Node& p = nodes_[prefix];
  const int32_t parent = c.parent;
  p.key.assign(c.key.begin(), c.key.begin() + at);
  p.pages.assign(c.pages.begin(), c.pages.begin() + at / page_size_);
  p.id = next_id_++;
  p.last_access = c.last_access;
  p.lock_ref = c.lock_ref;  // the locked pages stay protected
  ++num_nodes_;
  remove_child(parent, child);  // before the key changes: it is looked up by key[0]
  c.key.erase(c.key.begin(), c.key.begin() + at);
  c.pages.erase(c.pages.begin(), c.pages.begin() + at / page_size_);
  add_child(parent, prefix);
  add_child(prefix, child);
  return prefix;
}

void RadixTree::push_candidate(int32_t slot) {
  const Node& n = nodes_[slot];
  heap_.push_back({n.last_access, n.id, slot});
  std::push_heap(heap_.begin(), heap_.end());
  if (static_cast<int64_t>(heap_.size()) > 2 * num_nodes_ + 64) compact_heap();
}

void RadixTree::compact_heap() {
  std::unordered_set<int64_t> seen;
  std::vector<HeapEntry> kept;
  for (const HeapEntry& e : heap_) {
    const Node& n = nodes_[e.slot];
    if (n.id == e.id && is_candidate(e.slot) && n.last_access == e.last_access &&
        seen.insert(e.id).second)
      kept.push_back(e);
  }
  std::make_heap(kept.begin(), kept.end());
  heap_.swap(kept);
}

RadixTree::Match RadixTree::match_prefix(const int32_t* tokens, int64_t n, int32_t root) {
  const int64_t end = n - n % page_size_;
  const int64_t now = ++clock_;
  int32_t node = root;
  int64_t pos = 0;
  path_.clear();
  while (pos < end) {
    int32_t child = find_child(node, tokens + pos);
    if (child == kNoSlot) break;
    int64_t c = common_len(child, tokens + pos, end - pos);
    c -= c % page_size_;
    const bool ends_inside = c < static_cast<int64_t>(nodes_[child].key.size());
    if (ends_inside) child = split(child, c);
    nodes_[child].last_access = now;
    path_.push_back(child);
    pos += c;
    node = child;
    if (ends_inside) break;
  }
  if (!is_root(node) && is_candidate(node)) push_candidate(node);
  return {pos, {node, nodes_[node].id}};
}

void RadixTree::copy_match_pages(int32_t* out) const {
  for (int32_t s : path_) {
    const std::vector<int32_t>& p = nodes_[s].pages;
    std::memcpy(out, p.data(), sizeof(int32_t) * p.size());
    out += p.size();
  }
}

int64_t RadixTree::peek_prefix(const int32_t* tokens, int64_t n, int32_t root) const {
  const int64_t end = n - n % page_size_;
  int32_t node = root;
  int64_t pos = 0;
  while (node != kNoSlot && pos < end) {
    int32_t child = find_child(node, tokens + pos);
    if (child == kNoSlot) break;
    int64_t c = common_len(child, tokens + pos, end - pos);
    c -= c % page_size_;
    pos += c;
    if (c < static_cast<int64_t>(nodes_[child].key.size())) break;
    node = child;
  }
  return pos;
}

bool RadixTree::newer(int32_t a, int32_t b) const {
  const Node& x = nodes_[a];
  const Node& y = nodes_[b];
  return x.last_access != y.last_access ? x.last_access > y.last_access : x.id > y.id;
}

void RadixTree::continuation(const int32_t* tokens, int64_t n, int32_t root, int64_t max_len,
                             std::vector<int32_t>& out) const {
  out.clear();
  if (root == kNoSlot || max_len <= 0) return;
  int32_t node = root;
  int64_t pos = 0;
  int64_t off = 0;  // where in node's edge the continuation starts
  while (true) {
    const int64_t rest = n - pos;
    if (rest == 0) {
      off = static_cast<int64_t>(nodes_[node].key.size());
      break;
    }
    int32_t child = kNoSlot;
    if (rest >= page_size_) {
      child = find_child(node, tokens + pos);
      if (child == kNoSlot) return;
      const int64_t len = static_cast<int64_t>(nodes_[child].key.size());
      const int64_t c = common_len(child, tokens + pos, rest);
      if (c == len) {
        pos += c;
        node = child;
        continue;
      }
      if (c < rest) return;  // a different token: not a cached path
      node = child;
      off = c;
      break;
    }
    // A last partial page: the most recently used child whose edge starts with it.
    for_each_child(node, [&](int32_t c) {
      if (std::memcmp(nodes_[c].key.data(), tokens + pos, sizeof(int32_t) * rest) == 0 &&
          (child == kNoSlot || newer(c, child)))
        child = c;
    });
    if (child == kNoSlot) return;
    node = child;
    off = rest;
    break;
  }
  while (true) {
    const std::vector<int32_t>& key = nodes_[node].key;
    const int64_t take = std::min<int64_t>(static_cast<int64_t>(key.size()) - off,
                                           max_len - static_cast<int64_t>(out.size()));
    out.insert(out.end(), key.begin() + off, key.begin() + off + take);
    if (static_cast<int64_t>(out.size()) >= max_len) return;
    int32_t next = kNoSlot;
    for_each_child(node, [&](int32_t c) {
      if (next == kNoSlot || newer(c, next)) next = c;
    });
    if (next == kNoSlot) return;
    node = next;
    off = 0;
  }
}

RadixTree::Match RadixTree::insert(const int32_t* tokens, int64_t n, const int32_t* pages,
                                   int32_t root) {
  const int64_t end = n - n % page_size_;
  const int64_t now = ++clock_;
  int32_t node = root;
  int64_t pos = 0;
  while (pos < end) {
    int32_t child = find_child(node, tokens + pos);
    if (child == kNoSlot) {
      const int32_t leaf = new_slot();
      Node& l = nodes_[leaf];
      l.key.assign(tokens + pos, tokens + end);
      l.pages.assign(pages + pos / page_size_, pages + end / page_size_);
      l.id = next_id_++;
      l.last_access = now;
      ++num_nodes_;
      evictable_ += static_cast<int64_t>(l.pages.size());
      add_child(node, leaf);
      push_candidate(leaf);
      return {pos, {leaf, nodes_[leaf].id}};
    }
    int64_t c = common_len(child, tokens + pos, end - pos);
    c -= c % page_size_;
    if (c < static_cast<int64_t>(nodes_[child].key.size())) child = split(child, c);
    nodes_[child].last_access = now;
    pos += c;
    node = child;
  }
  if (!is_root(node) && is_candidate(node)) push_candidate(node);
  return {pos, {node, nodes_[node].id}};
}

void RadixTree::lock(NodeRef ref) {
  if (ref.id == kRootId) return;  // roots need no lock
  if (!live(ref)) throw MisuseError("lock of a node that is no longer in the tree: " + describe(ref));
  for (int32_t s = ref.slot; !is_root(s); s = nodes_[s].parent) {
    Node& n = nodes_[s];
    if (n.lock_ref == 0) {
      const int64_t k = static_cast<int64_t>(n.pages.size());
      evictable_ -= k;
      protected_ += k;
    }
    ++n.lock_ref;
  }
}

void RadixTree::unlock(NodeRef ref) {
  if (ref.id == kRootId) return;
  if (!live(ref))
    throw MisuseError("unlock of a node that is no longer in the tree: " + describe(ref));
  if (nodes_[ref.slot].lock_ref <= 0) throw MisuseError("unlock below zero: " + describe(ref));
  const bool leaf = nodes_[ref.slot].num_children == 0;
  for (int32_t s = ref.slot; !is_root(s); s = nodes_[s].parent) {
    Node& n = nodes_[s];
    if (--n.lock_ref == 0) {
      const int64_t k = static_cast<int64_t>(n.pages.size());
      protected_ -= k;
      evictable_ += k;
    }
  }
  if (leaf && nodes_[ref.slot].lock_ref == 0) push_candidate(ref.slot);
}

int64_t RadixTree::evict(int64_t num_pages, std::vector<int32_t>& victims) {
  int64_t freed = 0;
  while (freed < num_pages && !heap_.empty()) {
    std::pop_heap(heap_.begin(), heap_.end());
    const HeapEntry e = heap_.back();
    heap_.pop_back();
    const Node& n = nodes_[e.slot];
    if (n.id != e.id || n.last_access != e.last_access || !is_candidate(e.slot)) continue;
    const int32_t parent = n.parent;
    remove_child(parent, e.slot);
    --num_nodes_;
    evictable_ -= static_cast<int64_t>(n.pages.size());
    freed += static_cast<int64_t>(n.pages.size());
    victims.insert(victims.end(), n.pages.begin(), n.pages.end());
    free_slot(e.slot);
    Node& p = nodes_[parent];
    if (p.num_children > 0) continue;
    if (p.id == kRootId) {
      if (p.has_salt) {  // an empty salt namespace is dropped
        salt_roots_.erase(p.salt);
        free_slot(parent);
      }
    } else if (p.lock_ref == 0) {
      heap_.push_back({p.last_access, p.id, parent});
      std::push_heap(heap_.begin(), heap_.end());
    }
  }
  return freed;
}

void RadixTree::reset(std::vector<int32_t>& pages) {
  if (protected_ > 0)
    throw MisuseError(
        "reset() while requests hold locks on the tree; evict the unlocked part instead");
  all_pages(pages);
  // Ascending order, as the reference does: the allocator's state after a
  // reset then does not depend on the order children were visited in.
  std::sort(pages.begin(), pages.end());
  nodes_.resize(1);
  nodes_[kDefaultRoot].children.clear();
  nodes_[kDefaultRoot].num_children = 0;
  free_slots_.clear();
  salt_roots_.clear();
  heap_.clear();
  path_.clear();
  num_nodes_ = evictable_ = protected_ = 0;  // clock_ and next_id_ keep running
}

template <class F>
void RadixTree::for_each_child(int32_t node, F&& f) const {
  for (const auto& kv : nodes_[node].children)
    for (int32_t c = kv.second; c != kNoSlot; c = nodes_[c].next_sibling) f(c);
}

template <class F>
void RadixTree::for_each_node(F&& f) const {
  std::vector<int32_t> stack;
  for_each_child(kDefaultRoot, [&](int32_t c) { stack.push_back(c); });
  for (const auto& kv : salt_roots_)
    for_each_child(kv.second, [&](int32_t c) { stack.push_back(c); });
  while (!stack.empty()) {
    const int32_t s = stack.back();
    stack.pop_back();
    f(s);
    for_each_child(s, [&](int32_t c) { stack.push_back(c); });
  }
}

void RadixTree::all_pages(std::vector<int32_t>& out) const {
  for_each_node([&](int32_t s) {
    out.insert(out.end(), nodes_[s].pages.begin(), nodes_[s].pages.end());
  });
}

void RadixTree::export_nodes(int64_t max_label, bool every_namespace,
                             const std::string* only_salt, Export& out) const {
  out = Export{};
  // ((has a salt, the salt), root slot): the default namespace first, then by salt.
  std::vector<std::pair<std::pair<bool, std::string>, int32_t>> roots;
  if (every_namespace || only_salt == nullptr)
    roots.push_back({{false, std::string()}, kDefaultRoot});
  if (every_namespace) {
    for (const auto& kv : salt_roots_) roots.push_back({{true, kv.first}, kv.second});
    std::sort(roots.begin() + 1, roots.end());
  } else if (only_salt != nullptr) {
    auto it = salt_roots_.find(*only_salt);
    if (it != salt_roots_.end()) roots.push_back({{true, *only_salt}, it->second});
  }
  std::vector<int32_t> kids;
  auto sorted_children = [&](int32_t node) {
    kids.clear();
    for_each_child(node, [&](int32_t c) { kids.push_back(c); });
    std::sort(kids.begin(), kids.end(),
              [&](int32_t a, int32_t b) { return nodes_[a].id < nodes_[b].id; });
    return kids;
  };
  // (slot, parent index, namespace index), breadth first.
  std::vector<std::tuple<int32_t, int32_t, int32_t>> queue;
  for (const auto& r : roots) {
    bool used = false;
    for (int32_t c : sorted_children(r.second)) {
      queue.emplace_back(c, -1, static_cast<int32_t>(out.salts.size()));
      used = true;
    }
    if (used) out.salts.push_back(r.first);
  }
  out.label_offsets.push_back(0);
  for (size_t i = 0; i < queue.size(); ++i) {
    const auto [slot, parent, ns] = queue[i];
    const Node& n = nodes_[slot];
    out.parent.push_back(parent);
    out.ns.push_back(ns);
    out.id.push_back(n.id);
    out.last_access.push_back(n.last_access);
    out.lock_ref.push_back(n.lock_ref);
    const int64_t len = static_cast<int64_t>(n.key.size());
    out.num_tokens.push_back(len);
    const int64_t take = max_label < 0 ? len : std::min(max_label, len);
    out.labels.insert(out.labels.end(), n.key.begin(), n.key.begin() + take);
    out.label_offsets.push_back(static_cast<int64_t>(out.labels.size()));
    for (int32_t c : sorted_children(slot))
      queue.emplace_back(c, static_cast<int32_t>(i), ns);
  }
}

RadixTree::NodeInfo RadixTree::info(NodeRef ref) const {
  if (ref.id == kRootId) return {true, 0, 0, 0};
  if (!live(ref)) return {false, 0, 0, 0};
  const Node& n = nodes_[ref.slot];
  return {true, n.lock_ref, n.last_access, static_cast<int64_t>(n.key.size())};
}

std::string RadixTree::describe(NodeRef ref) const {
  std::string out = "RadixNode(id=" + std::to_string(ref.id);
  if (live(ref)) {
    const Node& n = nodes_[ref.slot];
    out += ", tokens=" + std::to_string(n.key.size()) + ", pages=" +
           std::to_string(n.pages.size()) + ", lock_ref=" + std::to_string(n.lock_ref) +
           ", last_access=" + std::to_string(n.last_access);
  } else {
    out += ", detached";
  }
  return out + ")";
}

namespace {
void require(bool cond, const std::string& what) {
  if (!cond) throw InvariantError("radix tree invariant broken: " + what);
}
}  // namespace

void RadixTree::check() const {
  require(is_root(kDefaultRoot) && nodes_[kDefaultRoot].parent == kNoSlot &&
              !nodes_[kDefaultRoot].has_salt,
          "default root malformed");
  for (const auto& [salt, s] : salt_roots_)
    require(is_root(s) && nodes_[s].parent == kNoSlot && nodes_[s].has_salt &&
                nodes_[s].salt == salt,
            "root of salt '" + salt + "' malformed");
  std::unordered_set<int64_t> heap_ids;
  for (const HeapEntry& e : heap_)
    if (nodes_[e.slot].id == e.id && nodes_[e.slot].last_access == e.last_access)
      heap_ids.insert(e.id);
  for (int32_t s = 0; s < static_cast<int32_t>(nodes_.size()); ++s) {
    int32_t kids = 0;
    if (nodes_[s].id != kFreeId) for_each_child(s, [&](int32_t) { ++kids; });
    require(kids == nodes_[s].num_children, "child count of slot " + std::to_string(s));
  }
  int64_t evictable = 0, protected_pages = 0, count = 0, live_ids = 0;
  std::vector<int32_t> pages;
  for (const Node& n : nodes_) live_ids += n.id > 0;
  for_each_node([&](int32_t s) {
    const Node& n = nodes_[s];
    const std::string who = describe({s, n.id});
    ++count;
    require(n.parent != kNoSlot, who + " has no parent");
    const Node& p = nodes_[n.parent];
    require(!n.key.empty(), who + " has an empty edge");
    require(n.key.size() % page_size_ == 0, who + ": edge not a whole number of pages");
    require(n.pages.size() * page_size_ == n.key.size(), who + ": pages/tokens mismatch");
    require(find_child(n.parent, n.key.data()) == s, who + ": parent link broken");
    require(n.lock_ref >= 0, who + ": negative lock_ref");
    int64_t child_locks = 0;
    for_each_child(s, [&](int32_t c) { child_locks += nodes_[c].lock_ref; });
    require(n.lock_ref >= child_locks, who + ": lock_ref below the sum of its children's");
    require(p.id == kRootId || p.last_access >= n.last_access, who + ": newer than its parent");
    require(0 < n.id && n.id < next_id_, who + ": id out of range");
    if (n.lock_ref) {
      protected_pages += static_cast<int64_t>(n.pages.size());
    } else {
      evictable += static_cast<int64_t>(n.pages.size());
      if (n.num_children == 0)
        require(heap_ids.count(n.id) > 0, who + ": evictable leaf not in heap");
    }
    pages.insert(pages.end(), n.pages.begin(), n.pages.end());
  });
  require(count == num_nodes_,
          "node count " + std::to_string(num_nodes_) + " != actual " + std::to_string(count));
  require(live_ids == count, "a detached node still holds a slot");
  require(evictable == evictable_,
          "evictable " + std::to_string(evictable_) + " != " + std::to_string(evictable));
  require(protected_pages == protected_, "protected " + std::to_string(protected_) +
                                             " != " + std::to_string(protected_pages));
  std::sort(pages.begin(), pages.end());
  require(std::adjacent_find(pages.begin(), pages.end()) == pages.end(),
          "a page is owned by two nodes");
}

}  // namespace radixserve
