//! The staggered schedule, computed on the host: which rows each segment takes and the order in
//! which every segment's steps and the cross-segment waits are enqueued.
//!
//! One prompt chunk of `n` rows is split into `segments` (1..=[`MAX_SEGMENTS`]) contiguous row
//! ranges, each run on its own lane (stream). Per layer, a segment's *dependent* step (the
//! mixer, or the pre step when it reads state the previous segment leaves, such as a
//! convolution tail) needs the previous segment's mixer of the same layer; everything else
//! overlaps. Because each segment runs exactly the serial computation on its rows, and every
//! dependency is ordered, the result is bit-identical to the serial run.
//!
//! Invariants of [`schedule`]:
//! - Every segment's steps appear in serial order: `Begin`, then per layer `Pre`, `Mixer`,
//!   `Post`, then `Finish`.
//! - For `k > 0`, the dependent step of `(k, layer)` is preceded (in enqueue order, on lane `k`)
//!   by `WaitHandoff { segment: k, layer }`, itself enqueued after
//!   `SignalHandoff { segment: k - 1, layer }`. The host enqueues layer by layer, so a wait
//!   captures exactly the record of its own layer (a CUDA wait takes the latest record made
//!   before it was enqueued), never an older one.
//! - `Fork` comes first (side lanes wait for the caller's earlier work) and `Join` last (the
//!   caller waits for every side lane).

/// Most segments a chunk is split into.
pub const MAX_SEGMENTS: usize = 4;

/// Which step of segment `k` waits for segment `k - 1`'s mixer of the same layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wait {
    /// The pre step reads state the previous segment leaves (e.g. a convolution tail).
    Pre,
    /// Only the mixer (attention over earlier rows, a recurrent state) depends on it.
    Mixer,
}

/// One enqueue, in host order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Step {
    /// Record the fork event on the caller's stream; every side lane waits on it.
    Fork,
    Begin {
        segment: usize,
    },
    /// Lane `segment` waits for the handoff segment `segment - 1` recorded.
    WaitHandoff {
        segment: usize,
        layer: usize,
    },
    Pre {
        segment: usize,
        layer: usize,
    },
    Mixer {
        segment: usize,
        layer: usize,
    },
    /// Lane `segment` records its handoff event (after its mixer of `layer`).
    SignalHandoff {
        segment: usize,
        layer: usize,
    },
    Post {
        segment: usize,
        layer: usize,
    },
    Finish {
        segment: usize,
    },
    /// Every side lane records its join event; the caller waits on each.
    Join,
}

impl Step {
    /// The segment whose lane runs this step (`None` for fork/join, which touch every lane).
    pub fn segment(&self) -> Option<usize> {
        match *self {
            Step::Fork | Step::Join => None,
            Step::Begin { segment }
            | Step::Finish { segment }
            | Step::WaitHandoff { segment, .. }
            | Step::Pre { segment, .. }
            | Step::Mixer { segment, .. }
            | Step::SignalHandoff { segment, .. }
            | Step::Post { segment, .. } => Some(segment),
        }
    }
}

/// Why a schedule cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StaggerError {
    #[error("{segments} segments asked: between 1 and {MAX_SEGMENTS} are supported")]
    SegmentCount { segments: usize },
    #[error("{rows} rows cannot be split into {segments} non-empty segments")]
    TooFewRows { rows: usize, segments: usize },
}

fn check_count(segments: usize) -> Result<(), StaggerError> {
    if segments == 0 || segments > MAX_SEGMENTS {
        return Err(StaggerError::SegmentCount { segments });
    }
    Ok(())
}

/// Rows of segment `k` when `n` rows are split into `parts`: near-equal, the first ones longer.
pub fn rows(n: usize, parts: usize, k: usize) -> usize {
    if parts == 0 || k >= parts {
        return 0;
    }
    n / parts + usize::from(k < n % parts)
}

/// First row of segment `k`.
pub fn start(n: usize, parts: usize, k: usize) -> usize {
    if parts == 0 {
        return 0;
    }
    let k = k.min(parts);
    k * (n / parts) + k.min(n % parts)
}

/// The row ranges `[start, start + rows)` of every segment.
pub fn split(n: usize, segments: usize) -> Result<Vec<std::ops::Range<usize>>, StaggerError> {
    check_count(segments)?;
    if n < segments {
        return Err(StaggerError::TooFewRows { rows: n, segments });
    }
    Ok((0..segments)
        .map(|k| start(n, segments, k)..start(n, segments, k) + rows(n, segments, k))
        .collect())
}

/// The enqueue order for `segments` segments over `layers` layers (see the module invariants).
pub fn schedule(segments: usize, layers: usize, wait: Wait) -> Result<Vec<Step>, StaggerError> {
    check_count(segments)?;
    let mut steps = Vec::with_capacity(2 + 2 * segments + layers * segments * 5);
    let staggered = segments > 1;
    if staggered {
        steps.push(Step::Fork);
    }
    steps.extend((0..segments).map(|segment| Step::Begin { segment }));
    for layer in 0..layers {
        for segment in 0..segments {
            let waits = segment > 0;
            if waits && wait == Wait::Pre {
                steps.push(Step::WaitHandoff { segment, layer });
            }
            steps.push(Step::Pre { segment, layer });
            if waits && wait == Wait::Mixer {
                steps.push(Step::WaitHandoff { segment, layer });
            }
            steps.push(Step::Mixer { segment, layer });
            if segment + 1 < segments {
                steps.push(Step::SignalHandoff { segment, layer });
            }
            steps.push(Step::Post { segment, layer });
        }
    }
    steps.extend((0..segments).map(|segment| Step::Finish { segment }));
    if staggered {
        steps.push(Step::Join);
    }
    Ok(steps)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rows_and_starts() {
        assert_eq!(
            (0..3).map(|k| rows(10, 3, k)).collect::<Vec<_>>(),
            vec![4, 3, 3]
        );
        assert_eq!(
            (0..4).map(|k| start(10, 3, k)).collect::<Vec<_>>(),
            vec![0, 4, 7, 10]
        );
        assert_eq!(split(10, 3).unwrap(), vec![0..4, 4..7, 7..10]);
        assert_eq!(
            split(2, 3),
            Err(StaggerError::TooFewRows {
                rows: 2,
                segments: 3
            })
        );
        assert_eq!(
            split(10, 5),
            Err(StaggerError::SegmentCount { segments: 5 })
        );
        assert_eq!(
            schedule(0, 1, Wait::Mixer),
            Err(StaggerError::SegmentCount { segments: 0 })
        );
    }

    #[test]
    fn one_segment_is_the_serial_order_without_events() {
        let steps = schedule(1, 2, Wait::Mixer).unwrap();
        assert_eq!(
            steps,
            vec![
                Step::Begin { segment: 0 },
                Step::Pre {
                    segment: 0,
                    layer: 0
                },
                Step::Mixer {
                    segment: 0,
                    layer: 0
                },
                Step::Post {
                    segment: 0,
                    layer: 0
                },
                Step::Pre {
                    segment: 0,
                    layer: 1
                },
                Step::Mixer {
                    segment: 0,
                    layer: 1
                },
                Step::Post {
                    segment: 0,
                    layer: 1
                },
                Step::Finish { segment: 0 },
            ]
        );
    }

    proptest! {
        #[test]
        fn split_covers_every_row_once(n in 1usize..100_000, parts in 1usize..=MAX_SEGMENTS) {
            prop_assume!(n >= parts);
            let ranges = split(n, parts).unwrap();
            prop_assert_eq!(ranges[0].start, 0);
            prop_assert_eq!(ranges[parts - 1].end, n);
            for w in ranges.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
                prop_assert!(w[0].len() >= w[1].len());
                prop_assert!(w[0].len() - w[1].len() <= 1);
            }
        }

        #[test]
        fn every_dependent_step_waits_for_its_own_layers_signal(
            segments in 1usize..=MAX_SEGMENTS, layers in 0usize..6, pre in any::<bool>(),
        ) {
            let wait = if pre { Wait::Pre } else { Wait::Mixer };
            let steps = schedule(segments, layers, wait).unwrap();
            let pos = |s: Step| steps.iter().position(|x| *x == s);
            for k in 0..segments {
                // Serial order within the segment.
                let mut last = pos(Step::Begin { segment: k }).unwrap();
                for layer in 0..layers {
                    for s in [Step::Pre { segment: k, layer }, Step::Mixer { segment: k, layer }, Step::Post { segment: k, layer }] {
                        let p = pos(s).unwrap();
                        prop_assert!(p > last);
                        last = p;
                    }
                    if k > 0 {
                        let w = pos(Step::WaitHandoff { segment: k, layer }).unwrap();
                        let signal = pos(Step::SignalHandoff { segment: k - 1, layer }).unwrap();
                        let dependent = match wait {
                            Wait::Pre => pos(Step::Pre { segment: k, layer }).unwrap(),
                            Wait::Mixer => pos(Step::Mixer { segment: k, layer }).unwrap(),
                        };
                        prop_assert!(signal < w && w < dependent);
                        // The previous segment has not signalled a later layer yet: the wait
                        // captures exactly this layer's record.
                        if let Some(next) = pos(Step::SignalHandoff { segment: k - 1, layer: layer + 1 }) {
                            prop_assert!(w < next);
                        }
                    }
                }
                let finish = pos(Step::Finish { segment: k }).unwrap();
                prop_assert!(finish > last);
            }
            if segments > 1 {
                prop_assert_eq!(steps.first(), Some(&Step::Fork));
                prop_assert_eq!(steps.last(), Some(&Step::Join));
            }
        }
    }
}
