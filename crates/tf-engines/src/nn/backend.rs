//! Where a pipeline's models run: the f32 host references or the GPU backends. Both model pipelines take it.

/// Where the models run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The f32 host references (any machine; slow at full size).
    Host,
    /// The GPU backends on one device.
    Gpu,
}

impl Backend {
    /// The GPU when a CUDA driver opens and sees a device, else the host.
    pub fn detect() -> Backend {
        match tf_cuda::open_driver().and_then(|d| tf_cuda::driver_info(&d)) {
            Ok(info) if info.device_count > 0 => Backend::Gpu,
            _ => Backend::Host,
        }
    }

    /// Starts opening NVML on a thread of its own (beside a model's load) for the GPU backend: the board's energy
    /// over requests and jobs (`tf_cuda::power`); `None` on the host.
    pub fn open_power_library(self) -> Option<tf_cuda::power::OpeningLibrary> {
        matches!(self, Backend::Gpu).then(tf_cuda::power::PowerLibrary::open_in_background)
    }

    /// `"host"` or `"gpu"`.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Host => "host",
            Backend::Gpu => "gpu",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Backend;

    #[test]
    fn names() {
        assert_eq!(Backend::Host.name(), "host");
        assert_eq!(Backend::Gpu.name(), "gpu");
    }
}
