//! `ColdDrop`: a field of a packer or unpacker that only a message's rarer packs fill, and
//! whose drop costs a check in line rather than a call when they did not.
//!
//! Rust's drop glue for a `Vec`, a `SmallVec` or an `Option<Box<_>>` of a large type is a
//! function the compiler keeps out of line, so a `Packer` or an `Unpacker` dropped on every
//! message calls it for each such field, empty or not: about a tenth of a small message's
//! time in `mad_overhead --size 8` (119 -> 108 ns for both ends once they were checks).

use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use smallvec::SmallVec;

/// A value that may own nothing to drop (an empty container), and says so.
pub(crate) trait MayHold: Default {
    /// Whether dropping it would free or drop anything.
    fn holds_something(&self) -> bool;
}

impl<T> MayHold for Option<Box<T>> {
    #[inline]
    fn holds_something(&self) -> bool {
        self.is_some()
    }
}

impl<T> MayHold for Vec<T> {
    #[inline]
    fn holds_something(&self) -> bool {
        self.capacity() != 0
    }
}

impl<A: smallvec::Array> MayHold for SmallVec<A> {
    #[inline]
    fn holds_something(&self) -> bool {
        !self.is_empty() || self.spilled()
    }
}

/// `T`, dropped by a call only when it holds something.
#[derive(Default)]
pub(crate) struct ColdDrop<T: MayHold>(ManuallyDrop<T>);

impl<T: MayHold> ColdDrop<T> {
    #[inline]
    pub(crate) fn new(v: T) -> Self {
        ColdDrop(ManuallyDrop::new(v))
    }

    /// The value, leaving an empty one.
    #[inline]
    pub(crate) fn take(&mut self) -> T {
        std::mem::take(&mut *self.0)
    }
}

impl<T: MayHold> Deref for ColdDrop<T> {
    type Target = T;
    #[inline]
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: MayHold> DerefMut for ColdDrop<T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

impl<T: MayHold> Drop for ColdDrop<T> {
    #[inline]
    fn drop(&mut self) {
        if self.0.holds_something() {
            drop_out_of_line(self.take());
        }
        // What is left in the `ManuallyDrop` is an empty value: nothing to drop.
    }
}

#[cold]
#[inline(never)]
fn drop_out_of_line<T>(v: T) {
    drop(v);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::rc::Rc;

    /// Whatever it holds is dropped exactly once: boxes, elements, a spilled but emptied
    /// small vector's heap buffer (checked by the reference counts).
    #[test]
    fn drops_what_it_holds_once() {
        let rc = Rc::new(());
        {
            let _b = ColdDrop::new(Some(Box::new(rc.clone())));
            let mut v: ColdDrop<Vec<Rc<()>>> = ColdDrop::default();
            v.push(rc.clone());
            let mut s: ColdDrop<SmallVec<[Rc<()>; 1]>> = ColdDrop::default();
            s.push(rc.clone());
            s.push(rc.clone());
            assert!(s.spilled());
            assert_eq!(Rc::strong_count(&rc), 5);
        }
        assert_eq!(Rc::strong_count(&rc), 1);
        let mut s: ColdDrop<SmallVec<[Rc<()>; 1]>> = ColdDrop::default();
        s.extend([rc.clone(), rc.clone()]);
        s.clear();
        assert!(s.holds_something(), "an emptied spilled vector still owns its buffer");
        let taken = s.take();
        assert!(!s.holds_something() && taken.spilled());
    }
}
