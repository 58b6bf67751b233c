#include "page_free.h"

#include <cstring>

namespace radixserve {

int64_t push_free_pages(int32_t* stack, uint8_t* allocated, int64_t num_pages, int64_t top,
                        const int32_t* ids, int64_t k) {
  for (int64_t i = 0; i < k; ++i)
    if (ids[i] < 0 || ids[i] >= num_pages || !allocated[ids[i]]) return -1;
  // Clearing the bit as we go finds repeats: a repeated id sees its bit
  // already clear. Undo the clears made so far before reporting it.
  for (int64_t i = 0; i < k; ++i) {
    if (!allocated[ids[i]]) {
      for (int64_t j = 0; j < i; ++j) allocated[ids[j]] = 1;
      return -1;
    }
    allocated[ids[i]] = 0;
  }
  // All k ids were allocated and distinct, so the stack has room for them.
  std::memcpy(stack + top, ids, sizeof(int32_t) * k);
  return top + k;
}

}  // namespace radixserve
