//! How a pipeline holds its components on the device: all resident, or loaded, run and freed in turn.
//!
//! A pipeline lists its components with the bytes each needs while it runs (weights plus its largest workspace)
//! and the device budget (free memory less a reserve). [`MemoryPlan::decide`] keeps everything resident when the
//! sum fits, else runs the components one at a time ([`Residency::Sequential`]) when the largest one fits alone,
//! else refuses with the numbers. Qwen-Image 2.1 fits on every supported card (all resident); the MiniMax H3 text
//! encoder and DiT (about 120 GB together in bf16) need the sequential mode on an 80 GB card. The plan is printed
//! in the load report.
//!
//! ```
//! use tf_engines::nn::memory_plan::{Component, MemoryPlan, Residency};
//!
//! let plan = MemoryPlan::decide(
//!     vec![Component::new("text encoder", 64 << 30), Component::new("DiT", 66 << 30)],
//!     80 << 30,
//! )?;
//! assert_eq!(plan.residency(), Residency::Sequential);
//! println!("{plan}");
//! # Ok::<(), tf_engines::nn::memory_plan::MemoryPlanError>(())
//! ```

use std::fmt;

use thiserror::Error;

/// One component of a pipeline and the device bytes it holds while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Component {
    pub name: String,
    pub bytes: u64,
}

impl Component {
    /// A component named `name` needing `bytes` on the device.
    pub fn new(name: impl Into<String>, bytes: u64) -> Component {
        Component {
            name: name.into(),
            bytes,
        }
    }
}

/// How the components are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Residency {
    /// Every component is loaded once and stays on the device.
    AllResident,
    /// One component at a time: load it, run it, free it, then the next.
    Sequential,
}

impl Residency {
    /// `"all resident"` or `"sequential"`.
    pub fn name(self) -> &'static str {
        match self {
            Residency::AllResident => "all resident",
            Residency::Sequential => "load, run and free in turn",
        }
    }
}

/// The components do not fit even one at a time.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error(
    "the {name} needs {bytes} B of device memory but the budget is {budget} B, so it cannot run even alone; \
     use a card with more memory, free other processes' memory, or choose a smaller dtype or model"
)]
pub struct MemoryPlanError {
    pub name: String,
    pub bytes: u64,
    pub budget: u64,
}

/// The decision and the figures it was made from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryPlan {
    components: Vec<Component>,
    budget: u64,
    residency: Residency,
}

impl MemoryPlan {
    /// All resident when the sum of `components` fits in `budget`; else sequential when the largest fits
    /// alone; else an error naming the component that cannot fit.
    pub fn decide(components: Vec<Component>, budget: u64) -> Result<MemoryPlan, MemoryPlanError> {
        let total = components
            .iter()
            .fold(0u64, |acc, c| acc.saturating_add(c.bytes));
        let residency = if total <= budget {
            Residency::AllResident
        } else if let Some(big) = components.iter().find(|c| c.bytes > budget) {
            return Err(MemoryPlanError {
                name: big.name.clone(),
                bytes: big.bytes,
                budget,
            });
        } else {
            Residency::Sequential
        };
        Ok(MemoryPlan {
            components,
            budget,
            residency,
        })
    }

    /// The decision.
    pub fn residency(&self) -> Residency {
        self.residency
    }

    /// The components, in pipeline order.
    pub fn components(&self) -> &[Component] {
        &self.components
    }

    /// The device budget the decision used.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Sum of the components' bytes (what all-resident holds).
    pub fn total(&self) -> u64 {
        self.components
            .iter()
            .fold(0u64, |acc, c| acc.saturating_add(c.bytes))
    }

    /// The largest component's bytes: the least budget the sequential mode runs under.
    pub fn largest(&self) -> u64 {
        self.components.iter().map(|c| c.bytes).max().unwrap_or(0)
    }

    /// Most bytes held at once under the decision: the total, or the largest component.
    pub fn peak(&self) -> u64 {
        match self.residency {
            Residency::AllResident => self.total(),
            Residency::Sequential => self.largest(),
        }
    }
}

impl fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
        write!(
            f,
            "memory plan: {} (peak {:.1} MiB",
            self.residency.name(),
            mib(self.peak())
        )?;
        // u64::MAX is the host backend's budget: no device memory bounds it.
        if self.budget == u64::MAX {
            write!(f, ", no device budget: unbounded;")?;
        } else {
            write!(f, " of a {:.1} MiB budget;", mib(self.budget))?;
        }
        for (i, c) in self.components.iter().enumerate() {
            let sep = if i == 0 { " " } else { ", " };
            write!(f, "{sep}{} {:.1} MiB", c.name, mib(c.bytes))?;
        }
        write!(f, ")")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn an_unbounded_budget_reads_as_such() {
        let host = MemoryPlan::decide(parts(&[GIB]), u64::MAX)
            .unwrap()
            .to_string();
        assert!(host.contains("no device budget: unbounded;"), "{host}");
        assert!(!host.contains("17592186044416"), "{host}");
        let device = MemoryPlan::decide(parts(&[GIB]), 2 * GIB)
            .unwrap()
            .to_string();
        assert!(device.contains("of a 2048.0 MiB budget;"), "{device}");
    }

    fn parts(sizes: &[u64]) -> Vec<Component> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| Component::new(format!("c{i}"), b))
            .collect()
    }

    #[test]
    fn everything_that_fits_stays_resident() {
        let plan = MemoryPlan::decide(parts(&[8 * GIB, 15 * GIB, GIB]), 141 * GIB).unwrap();
        assert_eq!(plan.residency(), Residency::AllResident);
        assert_eq!(plan.peak(), 24 * GIB);
        assert_eq!(plan.largest(), 15 * GIB);
        // Exactly the budget still fits.
        let plan = MemoryPlan::decide(parts(&[40 * GIB, 40 * GIB]), 80 * GIB).unwrap();
        assert_eq!(plan.residency(), Residency::AllResident);
    }

    #[test]
    fn too_much_together_runs_in_turn() {
        // The H3 text encoder and DiT in bf16 on an 80 GB card.
        let plan = MemoryPlan::decide(parts(&[64 * GIB, 66 * GIB, 2 * GIB]), 80 * GIB).unwrap();
        assert_eq!(plan.residency(), Residency::Sequential);
        assert_eq!(plan.peak(), 66 * GIB);
        assert!(plan.to_string().contains("in turn"), "{plan}");
    }

    #[test]
    fn a_component_larger_than_the_budget_is_refused() {
        let err = MemoryPlan::decide(parts(&[10 * GIB, 90 * GIB]), 80 * GIB).unwrap_err();
        assert_eq!(err.name, "c1");
        assert!(err.to_string().contains("cannot run even alone"), "{err}");
    }

    #[test]
    fn sums_saturate_instead_of_overflowing() {
        let half = u64::MAX / 2 + 1;
        let plan = MemoryPlan::decide(parts(&[half, half]), u64::MAX - 1).unwrap();
        assert_eq!(plan.residency(), Residency::Sequential);
        assert_eq!(plan.total(), u64::MAX);
        let plan = MemoryPlan::decide(Vec::new(), 0).unwrap();
        assert_eq!((plan.residency(), plan.peak()), (Residency::AllResident, 0));
    }
}
