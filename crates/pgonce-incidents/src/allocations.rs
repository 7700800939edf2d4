//! The unit tests' allocator: the system's, counting the bytes each thread
//! asks for, so that a test can state that a check does no work on the
//! heap ([`allocated_by`]). A count, not a time: the same on every machine
//! and under any load.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    /// Bytes this thread has asked the allocator for, fresh or grown.
    static ALLOCATED: Cell<usize> = const { Cell::new(0) };
}

/// Adds `bytes` to this thread's count. `try_with`: a thread's last
/// deallocations and allocations may run after its count is gone.
fn count(bytes: usize) {
    let _ = ALLOCATED.try_with(|n| n.set(n.get().saturating_add(bytes)));
}

/// [`System`], counting.
struct Counting;

// SAFETY: every call is handed to `System` unchanged; counting touches a
// thread-local `Cell` (const-initialized, no destructor), which allocates
// nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(layout.size());
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size.saturating_sub(layout.size()));
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// What `f` returns, and how many bytes it asked the allocator for on this
/// thread (fresh allocations and growth; frees are not subtracted).
pub(crate) fn allocated_by<R>(f: impl FnOnce() -> R) -> (R, usize) {
    let before = ALLOCATED.with(Cell::get);
    let result = f();
    (result, ALLOCATED.with(Cell::get) - before)
}
