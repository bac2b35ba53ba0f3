//! Qwen-Image 2.1 checkpoint variants: the base checkpoint and Turbo, the distilled few-step one.
//!
//! Both have the same components; what differs is how they are sampled, and the folder says which through its
//! pipeline config, read the way diffusers' modular loader reads it (`_qwenimage21_map_fn`): a `model_index.json`
//! whose `sample_sigmas` is a non-empty list loads as `QwenImage21TurboModularPipeline`, anything else as the
//! base pipeline. [`Variant::detect`] applies that rule; a caller may also name the variant (diffusers: the Turbo
//! blocks built on a folder explicitly).
//!
//! Turbo, as the reference runs it:
//! - the sigma grid is the folder's `sample_sigmas` (the scheduler config still shifts it), and without one
//!   `linspace(1, 1/N, N)` with N = [`TURBO_DEFAULT_STEPS`] (8);
//! - there is no guidance: one transformer call per step, no negative branch. A negative prompt or a guidance
//!   scale sent to it is not an input of that pipeline; diffusers warns that the unexpected input is ignored, and
//!   so do we ([`Ignored`], reported by the caller with its own field names);
//! - encode, the initial noise, the prefix KV cache, the Euler step and the decode are the base pipeline's.

use std::fmt;

/// The reference's default step count of a Turbo pipeline without `sample_sigmas`.
pub const TURBO_DEFAULT_STEPS: usize = 8;

/// Which Qwen-Image 2.1 checkpoint a folder holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// The base checkpoint (`QwenImage21Pipeline`): 40 steps by default, optional true CFG.
    Base,
    /// The distilled few-step checkpoint (`QwenImage21TurboModularPipeline`): its own sigma grid, no guidance.
    Turbo,
}

impl Variant {
    /// The variant diffusers loads for a folder whose `model_index.json` has these `sample_sigmas`: Turbo when
    /// the list is non-empty.
    pub fn detect(sample_sigmas: Option<&[f64]>) -> Variant {
        match sample_sigmas {
            Some(sigmas) if !sigmas.is_empty() => Variant::Turbo,
            _ => Variant::Base,
        }
    }

    /// `"base"` or `"turbo"`.
    pub fn name(self) -> &'static str {
        match self {
            Variant::Base => "base",
            Variant::Turbo => "turbo",
        }
    }

    /// The checkpoint's name for messages.
    pub fn title(self) -> &'static str {
        match self {
            Variant::Base => "Qwen-Image 2.1",
            Variant::Turbo => "Qwen-Image 2.1 Turbo",
        }
    }

    /// Whether requests may ask for true classifier-free guidance.
    pub fn guidance(self) -> bool {
        matches!(self, Variant::Base)
    }

    /// Steps when neither the request nor the folder's `sample_sigmas` fix them.
    pub fn default_steps(self) -> usize {
        match self {
            Variant::Base => super::pipeline::DEFAULT_STEPS,
            Variant::Turbo => TURBO_DEFAULT_STEPS,
        }
    }

    /// The request fields this variant does not use, given the negative prompt and guidance scale asked for.
    pub fn ignored(self, negative_prompt: Option<&str>, true_cfg_scale: f32) -> Vec<Ignored> {
        if self.guidance() {
            return Vec::new();
        }
        let mut ignored = Vec::new();
        if negative_prompt.is_some() {
            ignored.push(Ignored::NegativePrompt);
        }
        if true_cfg_scale != 1.0 {
            ignored.push(Ignored::GuidanceScale);
        }
        ignored
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.title())
    }
}

/// A request field the loaded variant does not use: the run goes on without it, as the reference's does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// The negative prompt (there is no negative branch).
    NegativePrompt,
    /// A true CFG scale other than 1 (there is no guidance).
    GuidanceScale,
}

/// Why Turbo ignores guidance inputs.
pub const NO_GUIDANCE_REASON: &str =
    "the Turbo checkpoint samples without guidance (one transformer call per \
     step, no negative branch), as diffusers' QwenImage21TurboModularPipeline does";

impl Ignored {
    /// The [`super::pipeline::Request`] field.
    pub fn field(self) -> &'static str {
        match self {
            Ignored::NegativePrompt => "negative_prompt",
            Ignored::GuidanceScale => "true_cfg_scale",
        }
    }

    /// Why it is ignored.
    pub fn reason(self) -> &'static str {
        NO_GUIDANCE_REASON
    }

    /// `"{name} is ignored: {reason}"`, with the caller's name for the field (a flag, a protocol key).
    pub fn message(self, name: &str) -> String {
        format!("{name} is ignored: {}", self.reason())
    }
}

impl fmt::Display for Ignored {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message(&format!("`{}`", self.field())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_follows_the_reference_map() {
        assert_eq!(Variant::detect(None), Variant::Base);
        // An empty list is falsy in the reference's check.
        assert_eq!(Variant::detect(Some(&[])), Variant::Base);
        assert_eq!(Variant::detect(Some(&[1.0, 0.5])), Variant::Turbo);
    }

    #[test]
    fn turbo_ignores_guidance_inputs_and_base_keeps_them() {
        assert!(Variant::Base.ignored(Some("blurry"), 4.0).is_empty());
        assert!(Variant::Turbo.ignored(None, 1.0).is_empty());
        assert_eq!(
            Variant::Turbo.ignored(Some(""), 1.0),
            vec![Ignored::NegativePrompt]
        );
        assert_eq!(
            Variant::Turbo.ignored(Some("blurry"), 4.0),
            vec![Ignored::NegativePrompt, Ignored::GuidanceScale]
        );
        assert_eq!(
            Variant::Turbo.ignored(None, 0.5),
            vec![Ignored::GuidanceScale]
        );
        let text = Ignored::GuidanceScale.to_string();
        assert!(text.starts_with("`true_cfg_scale` is ignored: "), "{text}");
        assert!(text.contains("without guidance"), "{text}");
        assert!(Ignored::NegativePrompt
            .message("--negative")
            .starts_with("--negative is ignored: "));
    }

    #[test]
    fn default_steps_and_names() {
        assert_eq!(Variant::Turbo.default_steps(), 8);
        assert_eq!(
            Variant::Base.default_steps(),
            super::super::pipeline::DEFAULT_STEPS
        );
        assert_eq!(
            (Variant::Base.name(), Variant::Turbo.name()),
            ("base", "turbo")
        );
        assert_eq!(Variant::Turbo.to_string(), "Qwen-Image 2.1 Turbo");
        assert!(Variant::Base.guidance() && !Variant::Turbo.guidance());
    }
}
