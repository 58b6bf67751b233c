// The page allocator's free(): validate and push page ids onto its free stack.
//
// The Python PageAllocator (radixserve/scheduler/allocator.py) owns the state
// (an int32 stack of free ids with `top` entries, an `allocated` bitmap); this
// is only its hot path, run on its own arrays, so its state is the same
// whichever side did the work. On any invalid id nothing changes and -1 comes
// back: the Python side then raises with the details.
#pragma once

#include <cstdint>

namespace radixserve {

// Returns the new top, or -1 when an id is out of [0, num_pages), not
// allocated, or given twice (then stack and bitmap are unchanged).
int64_t push_free_pages(int32_t* stack, uint8_t* allocated, int64_t num_pages, int64_t top,
                        const int32_t* ids, int64_t k);

}  // namespace radixserve
