//! Plain host tensors: a row-major buffer with its shape.
//!
//! These carry model inputs, reference outputs and KV caches between the weights reader, the host reference and
//! the `tf forward` front end. They hold no device state.

use thiserror::Error;

/// A shape did not match what an operation or a model expects.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{what}: expected {expected}, got {actual}")]
pub struct ShapeError {
    /// What was checked (a tensor or argument name).
    pub what: String,
    /// The expected shape or length, in words.
    pub expected: String,
    /// What was found.
    pub actual: String,
}

impl ShapeError {
    /// A shape error for `what`.
    pub fn new(
        what: impl Into<String>,
        expected: impl Into<String>,
        actual: impl Into<String>,
    ) -> Self {
        ShapeError {
            what: what.into(),
            expected: expected.into(),
            actual: actual.into(),
        }
    }
}

/// Number of elements of `shape`, or `None` on overflow.
pub fn element_count(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

/// The rows left once the first `drop` of `rows` (a prompt template's leading block) are removed; refuses a drop
/// that leaves no row.
pub fn rows_after_drop(rows: usize, drop: usize) -> Result<usize, ShapeError> {
    match rows.checked_sub(drop) {
        Some(kept) if kept > 0 => Ok(kept),
        _ => Err(ShapeError::new(
            "prompt",
            format!("more than the {drop} leading template rows to drop"),
            format!("{rows} tokens"),
        )),
    }
}

/// A row-major host tensor of `T`.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor<T> {
    shape: Vec<usize>,
    data: Vec<T>,
}

/// f32 host tensor (activations, weights converted to f32, outputs).
pub type TensorF32 = Tensor<f32>;

impl<T> Tensor<T> {
    /// Wraps `data` as a tensor of `shape`; the element count must match.
    pub fn new(shape: Vec<usize>, data: Vec<T>) -> Result<Self, ShapeError> {
        match element_count(&shape) {
            Some(n) if n == data.len() => Ok(Tensor { shape, data }),
            _ => Err(ShapeError::new(
                "tensor data",
                format!(
                    "{} elements for shape {:?}",
                    element_count(&shape).unwrap_or(usize::MAX),
                    shape
                ),
                format!("{} elements", data.len()),
            )),
        }
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The elements, row-major.
    pub fn data(&self) -> &[T] {
        &self.data
    }

    /// The elements, mutable.
    pub fn data_mut(&mut self) -> &mut [T] {
        &mut self.data
    }

    /// Consumes the tensor and returns its elements.
    pub fn into_data(self) -> Vec<T> {
        self.data
    }

    /// Rows `first..` of a `[rows, cols]` tensor, as `[rows - first, cols]` (`first` at most `rows`).
    pub fn skip_rows(mut self, first: usize) -> Result<Self, ShapeError> {
        let [rows, cols] = self.dims::<2>("tensor")?;
        let kept = rows.checked_sub(first).ok_or_else(|| {
            ShapeError::new(
                "rows to skip",
                format!("at most {rows}"),
                format!("{first}"),
            )
        })?;
        // In bounds: first * cols <= rows * cols = data.len().
        let data = self.data.split_off(first * cols);
        Tensor::new(vec![kept, cols], data)
    }

    /// Checks the rank and returns the dimensions; `what` names the tensor in the error.
    pub fn dims<const R: usize>(&self, what: &str) -> Result<[usize; R], ShapeError> {
        <[usize; R]>::try_from(self.shape.as_slice()).map_err(|_| {
            ShapeError::new(what, format!("rank {R}"), format!("shape {:?}", self.shape))
        })
    }
}

impl<T: Clone + Default> Tensor<T> {
    /// A tensor of `shape` filled with `T::default()`.
    pub fn zeros(shape: Vec<usize>) -> Result<Self, ShapeError> {
        let n = element_count(&shape).ok_or_else(|| {
            ShapeError::new(
                "tensor",
                "a shape whose size fits in memory",
                format!("{shape:?}"),
            )
        })?;
        Ok(Tensor {
            shape,
            data: vec![T::default(); n],
        })
    }
}

/// Relative L2 distance `|a - b| / |b|` (b is the reference), accumulated in f64. Returns `None` when lengths
/// differ. A zero reference gives the absolute norm of `a - b`.
pub fn relative_l2(a: &[f32], reference: &[f32]) -> Option<f64> {
    if a.len() != reference.len() {
        return None;
    }
    let (mut diff, mut norm) = (0f64, 0f64);
    for (&x, &r) in a.iter().zip(reference) {
        let d = f64::from(x) - f64::from(r);
        diff += d * d;
        norm += f64::from(r) * f64::from(r);
    }
    Some(if norm > 0.0 {
        (diff / norm).sqrt()
    } else {
        diff.sqrt()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_checks_element_count() {
        assert!(Tensor::new(vec![2, 3], vec![0f32; 6]).is_ok());
        let err = Tensor::new(vec![2, 3], vec![0f32; 5]).unwrap_err();
        assert!(err.to_string().contains("6 elements"), "{err}");
    }

    #[test]
    fn rows_are_dropped_from_the_front() {
        assert_eq!(rows_after_drop(5, 2).unwrap(), 3);
        assert!(rows_after_drop(2, 2).is_err());
        assert!(rows_after_drop(1, 3).is_err());
        let t = Tensor::new(vec![3, 2], vec![0f32, 1., 2., 3., 4., 5.]).unwrap();
        let kept = t.clone().skip_rows(1).unwrap();
        assert_eq!(
            (kept.shape(), kept.data()),
            (&[2, 2][..], &[2f32, 3., 4., 5.][..])
        );
        assert_eq!(t.clone().skip_rows(3).unwrap().shape(), &[0, 2]);
        assert!(t.clone().skip_rows(4).is_err());
        assert!(Tensor::new(vec![6], vec![0f32; 6])
            .unwrap()
            .skip_rows(1)
            .is_err());
    }

    #[test]
    fn dims_checks_rank() {
        let t = Tensor::new(vec![2, 3], vec![0f32; 6]).unwrap();
        assert_eq!(t.dims::<2>("t").unwrap(), [2, 3]);
        assert!(t.dims::<3>("t").is_err());
    }

    #[test]
    fn relative_l2_is_scaled_by_the_reference() {
        assert_eq!(relative_l2(&[1.0, 2.0], &[1.0, 2.0]), Some(0.0));
        let r = relative_l2(&[3.0, 4.0], &[0.0, 5.0]).unwrap();
        assert!((r - (10f64).sqrt() / 5.0).abs() < 1e-12);
        assert_eq!(relative_l2(&[1.0], &[1.0, 2.0]), None);
    }
}
