//! The DiT's KV cache on the device (`[layer][k|v][batch][prefix][heads * 128]` bf16, post-norm and post-RoPE) and
//! its conversion to and from the host cache ([`HostKvCache`], true head width).

use tf_cuda::DeviceBuffer;

use super::{bf16_bits, bf16_value, cuda_err, GpuDit};
use crate::nn::gpu::HEAD_DIM;
use crate::nn::tensor::TensorF32;
use crate::nn::weights::BF16;
use crate::qwen_image::dit::{DitError, HostKvCache};

/// The prefix K/V of every layer on the device.
#[derive(Debug)]
pub struct GpuKvCache {
    pub(super) batch: usize,
    pub(super) prefix_len: usize,
    /// Padded width per token (heads * 128).
    pub(super) width: usize,
    pub(super) layers: usize,
    pub(super) buffer: DeviceBuffer,
}

impl GpuKvCache {
    /// Samples.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Cached tokens per sample.
    pub fn prefix_len(&self) -> usize {
        self.prefix_len
    }

    pub(super) fn plane_bytes(&self) -> usize {
        self.batch * self.prefix_len * self.width * BF16
    }

    /// Byte offset of layer `layer`'s K (`which` 0) or V (1).
    pub(super) fn offset(&self, layer: usize, which: usize) -> usize {
        (layer * 2 + which) * self.plane_bytes()
    }

    /// The graph key of this cache; see [`CacheBinding`].
    pub(super) fn binding(&self) -> CacheBinding {
        CacheBinding {
            addr: self.buffer.addr(),
            bytes: self.buffer.len(),
            batch: self.batch,
            prefix_len: self.prefix_len,
            width: self.width,
            layers: self.layers,
        }
    }
}

/// Everything a step captured with a cache bakes into its graph: the buffer's address and size and the shape
/// that sets every offset into it. Two caches with the same binding (a request's cache freed and the next one
/// allocated at the same address, as the driver does for equal sizes) replay the same graph, so a warm worker
/// captures its cached step once instead of once per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CacheBinding {
    addr: u64,
    bytes: usize,
    batch: usize,
    prefix_len: usize,
    width: usize,
    layers: usize,
}

impl GpuDit {
    pub(super) fn alloc_cache(
        &self,
        batch: usize,
        prefix_len: usize,
    ) -> Result<GpuKvCache, DitError> {
        let dims = &self.engine.dims;
        let bytes = dims.layers * 2 * batch * prefix_len * dims.width * BF16;
        Ok(GpuKvCache {
            batch,
            prefix_len,
            width: dims.width,
            layers: dims.layers,
            buffer: DeviceBuffer::alloc(&self.engine.ctx, bytes)
                .map_err(cuda_err("allocating a KV cache"))?,
        })
    }

    /// The cache in host memory, at the true head width.
    pub(super) fn cache_to_host(&self, cache: &GpuKvCache) -> Result<HostKvCache, DitError> {
        let dims = &self.engine.dims;
        let bits: Vec<u16> = cache
            .buffer
            .to_vec()
            .map_err(cuda_err("downloading the KV cache"))?;
        let (b, p, w) = (cache.batch, cache.prefix_len, cache.width);
        let mut layers = Vec::with_capacity(cache.layers);
        for layer in 0..cache.layers {
            let mut kv = Vec::with_capacity(2);
            for which in 0..2 {
                let base = cache.offset(layer, which) / BF16;
                let mut values = Vec::with_capacity(b * p * dims.heads * dims.head_dim);
                for t in 0..b * p {
                    for h in 0..dims.heads {
                        let at = base + t * w + h * HEAD_DIM;
                        let src = bits.get(at..at + dims.head_dim).ok_or_else(|| {
                            DitError::KvCache("device cache is shorter than its shape".into())
                        })?;
                        values.extend(src.iter().map(|&x| bf16_value(x)));
                    }
                }
                kv.push(TensorF32::new(
                    vec![b, p, dims.heads, dims.head_dim],
                    values,
                )?);
            }
            let v = kv.pop();
            let k = kv.pop();
            if let (Some(k), Some(v)) = (k, v) {
                layers.push((k, v));
            }
        }
        Ok(HostKvCache {
            batch: b,
            prefix_len: p,
            heads: dims.heads,
            head_dim: dims.head_dim,
            layers,
        })
    }

    /// A device cache holding `cache` (checked against the model), padded to 128-wide heads.
    pub(super) fn cache_from_host(&mut self, cache: HostKvCache) -> Result<GpuKvCache, DitError> {
        cache.check(&self.engine.config, cache.batch, cache.prefix_len)?;
        let dims = self.engine.dims;
        let mut gpu = self.alloc_cache(cache.batch, cache.prefix_len)?;
        let (b, p, w) = (cache.batch, cache.prefix_len, dims.width);
        let mut bits = vec![0u16; gpu.buffer.len() / BF16];
        for (layer, (k, v)) in cache.layers.iter().enumerate() {
            for (which, t) in [(0usize, k), (1, v)] {
                let base = gpu.offset(layer, which) / BF16;
                for (token, row) in t
                    .data()
                    .chunks_exact(dims.heads * dims.head_dim)
                    .enumerate()
                    .take(b * p)
                {
                    for (h, head) in row.chunks_exact(dims.head_dim).enumerate() {
                        let at = base + token * w + h * HEAD_DIM;
                        for (dst, &x) in bits[at..at + dims.head_dim].iter_mut().zip(head) {
                            *dst = bf16_bits(x);
                        }
                    }
                }
            }
        }
        let bytes: Vec<u8> = bits.iter().flat_map(|x| x.to_le_bytes()).collect();
        gpu.buffer
            .upload(0, &bytes)
            .map_err(cuda_err("uploading the KV cache"))?;
        Ok(gpu)
    }
}
