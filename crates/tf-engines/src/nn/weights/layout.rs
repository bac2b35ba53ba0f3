//! The aligned device layout of a model's weights: tensors, or fused groups of them, placed one after another
//! in one allocation, each group starting at a multiple of the alignment.
//!
//! Every component plans its weights with [`LayoutPlanner`], so the rounding is the same everywhere: a group's
//! parts are contiguous (one GEMM reads a fused `q|k|v` group as one matrix), and the allocation's size is the
//! end of the last group rounded up. All arithmetic is checked: a layout that does not fit in `usize` is a
//! [`WeightsError::LayoutOverflow`] naming the part, never a wrap.

use super::WeightsError;

/// Bytes per bf16 element.
pub const BF16: usize = 2;
/// Alignment (bytes) of every weight group and workspace buffer the engines plan.
pub const ALIGN: usize = 256;

/// Bump allocator of weight groups in one device allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutPlanner {
    next: usize,
    align: usize,
}

impl Default for LayoutPlanner {
    fn default() -> Self {
        LayoutPlanner::new(ALIGN)
    }
}

fn overflow(what: &str) -> WeightsError {
    WeightsError::LayoutOverflow {
        what: what.to_string(),
    }
}

impl LayoutPlanner {
    /// An empty layout whose groups start at multiples of `align` (rounded up to a power of two, at least 1).
    pub fn new(align: usize) -> LayoutPlanner {
        LayoutPlanner {
            next: 0,
            align: align.max(1).checked_next_power_of_two().unwrap_or(ALIGN),
        }
    }

    /// A layout that continues after `next` bytes already used (for tests and appended layouts).
    pub fn starting_at(next: usize, align: usize) -> LayoutPlanner {
        LayoutPlanner {
            next,
            ..LayoutPlanner::new(align)
        }
    }

    /// The alignment of every group.
    pub fn align(&self) -> usize {
        self.align
    }

    fn round_up(&self, offset: usize, what: &str) -> Result<usize, WeightsError> {
        offset
            .checked_next_multiple_of(self.align)
            .ok_or_else(|| overflow(what))
    }

    /// Places consecutive parts (`bytes` each) in one aligned group; returns each part's offset.
    pub fn group(&mut self, parts: &[usize]) -> Result<Vec<usize>, WeightsError> {
        let mut offset = self.round_up(self.next, "a group's start")?;
        let mut out = Vec::with_capacity(parts.len());
        for &bytes in parts {
            out.push(offset);
            offset = offset
                .checked_add(bytes)
                .ok_or_else(|| overflow(&format!("a part of {bytes} B at offset {offset}")))?;
        }
        self.next = offset;
        Ok(out)
    }

    /// Places one tensor of `bytes` in its own aligned group; returns its offset.
    pub fn one(&mut self, bytes: usize) -> Result<usize, WeightsError> {
        let offset = self.round_up(self.next, "a tensor's start")?;
        self.next = offset
            .checked_add(bytes)
            .ok_or_else(|| overflow(&format!("a tensor of {bytes} B at offset {offset}")))?;
        Ok(offset)
    }

    /// The end of the last part placed (not rounded).
    pub fn end(&self) -> usize {
        self.next
    }

    /// The size of the allocation that holds every group: the end rounded up to the alignment.
    pub fn total(&self) -> Result<usize, WeightsError> {
        self.round_up(self.next, "the allocation's size")
    }
}

/// The little-endian bytes of `values`, each written by `to` (`f32::to_le_bytes`, `i32::to_le_bytes`, ...).
pub fn le_bytes<T: Copy, const N: usize>(values: &[T], to: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    values.iter().flat_map(|&v| to(v)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_contiguous_and_aligned() {
        let mut l = LayoutPlanner::starting_at(10, ALIGN);
        assert_eq!(l.group(&[100, 6, 50]).unwrap(), vec![256, 356, 362]);
        assert_eq!(l.one(4).unwrap(), 512);
        assert_eq!(l.end(), 516);
        assert_eq!(l.total().unwrap(), 768);
        assert_eq!(LayoutPlanner::new(3).align(), 4);
        assert_eq!(LayoutPlanner::new(0).align(), 1);
    }

    #[test]
    fn overflow_is_an_error_naming_the_part() {
        let mut l = LayoutPlanner::default();
        l.one(usize::MAX - 100).unwrap();
        let err = l.one(1).unwrap_err().to_string();
        assert!(err.contains("start"), "{err}");
        let mut l = LayoutPlanner::default();
        assert!(l.group(&[16, usize::MAX]).is_err());
        let mut l = LayoutPlanner::starting_at(usize::MAX - 1, 256);
        assert!(l.total().is_err());
        assert!(l.one(0).is_err());
    }

    #[test]
    fn le_bytes_writes_each_value_in_order() {
        assert_eq!(
            le_bytes(&[1i32, -1], i32::to_le_bytes),
            vec![1, 0, 0, 0, 255, 255, 255, 255]
        );
        assert_eq!(le_bytes(&[1u16], u16::to_le_bytes), vec![1, 0]);
    }
}
