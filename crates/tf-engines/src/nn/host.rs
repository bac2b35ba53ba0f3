//! Host reference ops: plain f32 on row-major slices with explicit shapes.
//!
//! Every GPU kernel is checked against these functions, so their signatures stay simple and stable. Each
//! function checks the slice lengths against the shapes first and returns a [`ShapeError`] on mismatch; reductions
//! (norms, dot products, softmax sums) accumulate in f64 so the reference is at least as accurate as what it
//! checks.
//!
//! Modulated ops take a table of modulation rows (`[n_mod, cols]`) and a row index per token (`row_mod`), which
//! is how a joint sequence mixes per-sample rows (target tokens) and the `t = 0` row (prefix tokens).

use crate::nn::tensor::ShapeError;

fn check_len(what: &str, slice_len: usize, expected: usize) -> Result<(), ShapeError> {
    if slice_len == expected {
        Ok(())
    } else {
        Err(ShapeError::new(
            what,
            format!("{expected} elements"),
            format!("{slice_len}"),
        ))
    }
}

fn checked_product(what: &str, dims: &[usize]) -> Result<usize, ShapeError> {
    dims.iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| ShapeError::new(what, "a size that fits in memory", format!("{dims:?}")))
}

fn check_row_mod(row_mod: &[usize], rows: usize, n_mod: usize) -> Result<(), ShapeError> {
    check_len("row_mod", row_mod.len(), rows)?;
    if let Some(bad) = row_mod.iter().find(|&&r| r >= n_mod) {
        return Err(ShapeError::new(
            "row_mod",
            format!("indices < {n_mod}"),
            format!("{bad}"),
        ));
    }
    Ok(())
}

/// Runs `work(first_row, rows)` over `out` cut into runs of whole rows of `row_len` values: one run on this thread
/// unless `parallel`, else one run per host thread (at most one per row), each on its own scoped thread. The rows a
/// run gets do not depend on where it runs, so a row-wise `work` gives the same values either way.
pub fn for_row_runs<T: Send>(
    out: &mut [T],
    row_len: usize,
    parallel: bool,
    work: impl Fn(usize, &mut [T]) + Sync,
) {
    let rows = out.len().checked_div(row_len).unwrap_or(0);
    let threads = if parallel {
        std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(rows)
    } else {
        1
    };
    if threads <= 1 {
        work(0, out);
        return;
    }
    let rows_per = rows.div_ceil(threads);
    let work = &work;
    std::thread::scope(|scope| {
        for (i, run) in out.chunks_mut(rows_per * row_len).enumerate() {
            scope.spawn(move || work(i * rows_per, run));
        }
    });
}

/// `out[r, o] = sum_i x[r, i] * weight[o, i]` (Y = X W^T, W in the PyTorch `[out, in]` layout, no bias).
/// Splits rows over the available cores when the product is large.
pub fn linear(
    x: &[f32],
    rows: usize,
    in_features: usize,
    weight: &[f32],
    out_features: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    check_len(
        "linear x",
        x.len(),
        checked_product("linear x", &[rows, in_features])?,
    )?;
    check_len(
        "linear weight",
        weight.len(),
        checked_product("linear weight", &[out_features, in_features])?,
    )?;
    check_len(
        "linear out",
        out.len(),
        checked_product("linear out", &[rows, out_features])?,
    )?;
    if rows == 0 || out_features == 0 {
        return Ok(());
    }
    if in_features == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let work = rows
        .saturating_mul(in_features)
        .saturating_mul(out_features);
    for_row_runs(out, out_features, work >= 1 << 20, |first, out_rows| {
        for (x_row, out_row) in x[first * in_features..]
            .chunks_exact(in_features)
            .zip(out_rows.chunks_exact_mut(out_features))
        {
            for (o, w_row) in out_row.iter_mut().zip(weight.chunks_exact(in_features)) {
                let mut acc = 0f64;
                for (&a, &b) in x_row.iter().zip(w_row) {
                    acc += f64::from(a) * f64::from(b);
                }
                *o = acc as f32;
            }
        }
    });
    Ok(())
}

/// Mean and reciprocal standard deviation of a row (biased variance), in f64.
fn mean_rstd(row: &[f32], eps: f32) -> (f64, f64) {
    let n = row.len().max(1) as f64;
    let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    (mean, 1.0 / (var + f64::from(eps)).sqrt())
}

/// LayerNorm without affine parameters followed by `(1 + scale)` modulation:
/// `out[r] = (x[r] - mean) / sqrt(var + eps) * (1 + scale[row_mod[r]])`. `scale` is `[n_mod, cols]`.
#[allow(clippy::too_many_arguments)]
pub fn layer_norm_modulate(
    x: &[f32],
    rows: usize,
    cols: usize,
    scale: &[f32],
    n_mod: usize,
    row_mod: &[usize],
    eps: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let n = checked_product("layer_norm x", &[rows, cols])?;
    check_len("layer_norm x", x.len(), n)?;
    check_len("layer_norm out", out.len(), n)?;
    check_len(
        "layer_norm scale",
        scale.len(),
        checked_product("scale", &[n_mod, cols])?,
    )?;
    check_row_mod(row_mod, rows, n_mod)?;
    if cols == 0 {
        return Ok(());
    }
    for ((x_row, out_row), &m) in x
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .zip(row_mod)
    {
        let (mean, rstd) = mean_rstd(x_row, eps);
        let s_row = &scale[m * cols..(m + 1) * cols];
        for ((o, &v), &s) in out_row.iter_mut().zip(x_row).zip(s_row) {
            *o = ((f64::from(v) - mean) * rstd * (1.0 + f64::from(s))) as f32;
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn rms_norm_impl(
    what: &str,
    x: &[f32],
    rows: usize,
    cols: usize,
    weight: &[f32],
    weight_offset: f64,
    eps: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let n = checked_product(what, &[rows, cols])?;
    check_len(what, x.len(), n)?;
    check_len(what, out.len(), n)?;
    check_len(what, weight.len(), cols)?;
    if cols == 0 {
        return Ok(());
    }
    for (x_row, out_row) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
        let ms = x_row
            .iter()
            .map(|&v| f64::from(v) * f64::from(v))
            .sum::<f64>()
            / cols as f64;
        let rrms = 1.0 / (ms + f64::from(eps)).sqrt();
        for ((o, &v), &w) in out_row.iter_mut().zip(x_row).zip(weight) {
            *o = (f64::from(v) * rrms * (f64::from(w) + weight_offset)) as f32;
        }
    }
    Ok(())
}

/// RMSNorm with a learnable weight (the QK norm): `out = x / sqrt(mean(x^2) + eps) * weight`, per row of `cols`.
/// For per-head norms pass `rows = tokens * heads`, `cols = head_dim`.
pub fn rms_norm(
    x: &[f32],
    rows: usize,
    cols: usize,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    rms_norm_impl("rms_norm", x, rows, cols, weight, 0.0, eps, out)
}

/// Zero-centred RMSNorm: the stored weight is `scale - 1`, so `out = x / sqrt(mean(x^2) + eps) * (weight + 1)`.
pub fn rms_norm_zero_centred(
    x: &[f32],
    rows: usize,
    cols: usize,
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    rms_norm_impl(
        "rms_norm_zero_centred",
        x,
        rows,
        cols,
        weight,
        1.0,
        eps,
        out,
    )
}

/// Inverse frequencies of one RoPE axis of `dim` channels (`dim / 2` pairs), as the reference computes them in
/// f32: `1 / theta^(2i / dim)`.
pub fn rope_inverse_frequencies(dim: usize, theta: f32) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| 1.0f32 / theta.powf((2 * i) as f32 / dim as f32))
        .collect()
}

/// Cos/sin tables `[tokens, sum(axes_dims) / 2]` for 3-axis RoPE: pair `j` of axis `a` rotates by
/// `positions[token][a] * inv_freq_a[j]` (angle rounded to f32 as the reference does). Axes are concatenated in
/// order (frame, height, width).
///
/// Each axis's entries depend only on that axis's position, and positions repeat (an image grid has one frame value
/// and a row or column value per line), so each distinct value of an axis is computed once and copied: a 1024x1024
/// step's tables in a fraction of the time of one trigonometric call per entry, with the same bits.
pub fn rope_tables(
    positions: &[[i64; 3]],
    axes_dims: [usize; 3],
    theta: f32,
) -> (Vec<f32>, Vec<f32>) {
    let inv: Vec<Vec<f32>> = axes_dims
        .iter()
        .map(|&d| rope_inverse_frequencies(d, theta))
        .collect();
    let pairs: usize = inv.iter().map(Vec::len).sum();
    let axes: Vec<AxisRope> = inv
        .iter()
        .enumerate()
        .map(|(axis, freqs)| AxisRope::new(positions, axis, freqs))
        .collect();
    let mut cos = Vec::with_capacity(positions.len() * pairs);
    let mut sin = Vec::with_capacity(positions.len() * pairs);
    for pos in positions {
        for (axis, table) in axes.iter().enumerate() {
            table.extend(pos[axis], &mut cos, &mut sin);
        }
    }
    (cos, sin)
}

/// Cos/sin tables as bf16 bits `[positions, 3 * freqs.len()]` for 3-axis RoPE at fractional positions (MiniMax H3's
/// normalised grids): for axis `a` and frequency `j`, the angle `position[a] * freqs[j]` in f32, its cosine and sine
/// taken in f64, rounded to f32 and then to bf16 (as a bfloat16 run of a reference casts its tables). An axis's
/// entries depend on that axis's value only, and values repeat from row to row (one frame, line or column value per
/// row of a grid): each distinct value (bit for bit) is computed once, and a row repeating the previous row's value
/// takes it without a lookup.
pub fn rope_tables_bf16(positions: &[[f32; 3]], freqs: &[f32]) -> (Vec<u16>, Vec<u16>) {
    let n = freqs.len();
    let mut cos = Vec::with_capacity(positions.len() * 3 * n);
    let mut sin = Vec::with_capacity(positions.len() * 3 * n);
    let mut first: [std::collections::HashMap<u32, usize>; 3] = Default::default();
    let mut last: [Option<(u32, usize)>; 3] = [None; 3];
    let mut made_cos: [Vec<u16>; 3] = Default::default();
    let mut made_sin: [Vec<u16>; 3] = Default::default();
    for p in positions {
        for (axis, &value) in p.iter().enumerate() {
            let key = value.to_bits();
            let at = match last[axis] {
                Some((bits, at)) if bits == key => at,
                _ => {
                    let (c, s) = (&mut made_cos[axis], &mut made_sin[axis]);
                    let at = *first[axis].entry(key).or_insert_with(|| {
                        let at = c.len();
                        for &w in freqs {
                            let angle = f64::from(value * w);
                            c.push(half::bf16::from_f32(angle.cos() as f32).to_bits());
                            s.push(half::bf16::from_f32(angle.sin() as f32).to_bits());
                        }
                        at
                    });
                    last[axis] = Some((key, at));
                    at
                }
            };
            cos.extend_from_slice(&made_cos[axis][at..at + n]);
            sin.extend_from_slice(&made_sin[axis][at..at + n]);
        }
    }
    (cos, sin)
}

/// One RoPE entry: the angle rounded to f32, its cosine and sine taken in f64 and rounded to f32.
fn rope_entry(position: i64, freq: f32) -> (f32, f32) {
    let angle = f64::from((position as f32) * freq);
    (angle.cos() as f32, angle.sin() as f32)
}

/// The cos/sin rows of one axis for every position value between the smallest and largest it takes, when that
/// range is no longer than the tokens (else entries are computed per token).
struct AxisRope<'f> {
    freqs: &'f [f32],
    table: Option<(i64, Vec<f32>, Vec<f32>)>,
}

impl<'f> AxisRope<'f> {
    fn new(positions: &[[i64; 3]], axis: usize, freqs: &'f [f32]) -> AxisRope<'f> {
        let values = positions.iter().map(|p| p[axis]);
        let table = match (values.clone().min(), values.max()) {
            (Some(lo), Some(hi)) => hi
                .checked_sub(lo)
                .and_then(|span| usize::try_from(span).ok())
                .filter(|&span| span < positions.len())
                .map(|span| {
                    let mut cos = Vec::with_capacity((span + 1) * freqs.len());
                    let mut sin = Vec::with_capacity((span + 1) * freqs.len());
                    for offset in 0..=span as i64 {
                        for &f in freqs {
                            let (c, s) = rope_entry(lo + offset, f);
                            cos.push(c);
                            sin.push(s);
                        }
                    }
                    (lo, cos, sin)
                }),
            _ => None,
        };
        AxisRope { freqs, table }
    }

    /// Appends the entries of `position` to the tables.
    fn extend(&self, position: i64, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        let n = self.freqs.len();
        if let Some((lo, c, s)) = &self.table {
            // In range by construction: `position` is one of the values the table spans.
            if let Some(at) = position
                .checked_sub(*lo)
                .and_then(|d| usize::try_from(d).ok())
                .map(|row| row * n)
                .filter(|&at| at + n <= c.len())
            {
                cos.extend_from_slice(&c[at..at + n]);
                sin.extend_from_slice(&s[at..at + n]);
                return;
            }
        }
        for &f in self.freqs {
            let (c, s) = rope_entry(position, f);
            cos.push(c);
            sin.push(s);
        }
    }
}

/// Interleaved complex RoPE in place: for each token, head and pair `j`, `(x[2j], x[2j+1])` is multiplied as a
/// complex number by `cos[t, j] + i sin[t, j]`. `x` is `[tokens, heads, head_dim]`, tables `[tokens, head_dim/2]`.
pub fn rope_interleaved(
    x: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) -> Result<(), ShapeError> {
    if !head_dim.is_multiple_of(2) {
        return Err(ShapeError::new(
            "rope head_dim",
            "an even number",
            head_dim.to_string(),
        ));
    }
    check_len(
        "rope x",
        x.len(),
        checked_product("rope x", &[tokens, heads, head_dim])?,
    )?;
    let half = head_dim / 2;
    check_len("rope cos", cos.len(), tokens * half)?;
    check_len("rope sin", sin.len(), tokens * half)?;
    if head_dim == 0 || heads == 0 {
        return Ok(());
    }
    for (t, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        let (c_row, s_row) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for head in token.chunks_exact_mut(head_dim) {
            for ((pair, &c), &s) in head.chunks_exact_mut(2).zip(c_row).zip(s_row) {
                let (re, im) = (pair[0], pair[1]);
                pair[0] = re * c - im * s;
                pair[1] = re * s + im * c;
            }
        }
    }
    Ok(())
}

/// Which keys a query may see, for a joint sequence of text and image blocks.
///
/// Query `i` sits at sequence position `q_offset + i`; key `k` at position `k`. A key is visible when
/// `key_valid[k]` and either `k <= q_pos` (causal) or both positions belong to the same image block
/// (`block_ids[q_pos] == block_ids[k] >= 0`; text is `-1`). Full attention over valid keys is the special case of
/// one block covering everything.
#[derive(Debug, Clone, Copy)]
pub struct AttentionMask<'a> {
    /// Position of the first query in the key sequence (the cached prefix length in cached mode).
    pub q_offset: usize,
    /// Block id per key position (`-1` for text), length = number of keys.
    pub block_ids: &'a [i32],
    /// Key padding mask (`false` = never attended), length = number of keys.
    pub key_valid: &'a [bool],
}

/// Multi-head attention with the block-causal + key-padding mask, scale `1/sqrt(head_dim)`.
/// `q` is `[sq, heads, head_dim]`, `k`/`v` `[skv, heads, head_dim]` (the cached prefix first, if any), `out`
/// `[sq, heads, head_dim]`. A query that sees no key gets zeros.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    sq: usize,
    skv: usize,
    heads: usize,
    head_dim: usize,
    mask: AttentionMask<'_>,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let row = checked_product("attention row", &[heads, head_dim])?;
    check_len("attention q", q.len(), checked_product("q", &[sq, row])?)?;
    check_len("attention k", k.len(), checked_product("k", &[skv, row])?)?;
    check_len("attention v", v.len(), checked_product("v", &[skv, row])?)?;
    check_len("attention out", out.len(), sq * row)?;
    check_len("attention block_ids", mask.block_ids.len(), skv)?;
    check_len("attention key_valid", mask.key_valid.len(), skv)?;
    if mask.q_offset + sq > skv {
        return Err(ShapeError::new(
            "attention q_offset",
            format!("q_offset + queries <= {skv} keys"),
            format!("{} + {sq}", mask.q_offset),
        ));
    }
    let scale = 1.0 / (head_dim.max(1) as f64).sqrt();
    let mut scores = vec![0f64; skv];
    let mut visible = vec![false; skv];
    for i in 0..sq {
        let q_pos = mask.q_offset + i;
        let q_block = mask.block_ids[q_pos];
        for (kpos, vis) in visible.iter_mut().enumerate() {
            let same_block = q_block >= 0 && mask.block_ids[kpos] == q_block;
            *vis = mask.key_valid[kpos] && (kpos <= q_pos || same_block);
        }
        for h in 0..heads {
            let q_vec = &q[(i * heads + h) * head_dim..(i * heads + h + 1) * head_dim];
            let mut max = f64::NEG_INFINITY;
            for (kpos, score) in scores.iter_mut().enumerate() {
                if !visible[kpos] {
                    continue;
                }
                let k_vec = &k[(kpos * heads + h) * head_dim..(kpos * heads + h + 1) * head_dim];
                let dot: f64 = q_vec
                    .iter()
                    .zip(k_vec)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
                *score = dot * scale;
                max = max.max(*score);
            }
            let o = &mut out[(i * heads + h) * head_dim..(i * heads + h + 1) * head_dim];
            if max == f64::NEG_INFINITY {
                o.fill(0.0);
                continue;
            }
            let mut acc = vec![0f64; head_dim];
            let mut denom = 0f64;
            for (kpos, &score) in scores.iter().enumerate() {
                if !visible[kpos] {
                    continue;
                }
                let p = (score - max).exp();
                denom += p;
                let v_vec = &v[(kpos * heads + h) * head_dim..(kpos * heads + h + 1) * head_dim];
                for (a, &vv) in acc.iter_mut().zip(v_vec) {
                    *a += p * f64::from(vv);
                }
            }
            for (dst, a) in o.iter_mut().zip(acc) {
                *dst = (a / denom) as f32;
            }
        }
    }
    Ok(())
}

/// SiLU: `x * sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    let x = f64::from(x);
    (x / (1.0 + (-x).exp())) as f32
}

/// GELU, tanh approximation: `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    let x = f64::from(x);
    let inner = (2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
    (0.5 * x * (1.0 + inner.tanh())) as f32
}

/// Applies SiLU in place.
pub fn silu_inplace(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = silu(*v));
}

/// Applies GELU (tanh) in place.
pub fn gelu_tanh_inplace(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = gelu_tanh(*v));
}

/// SwiGLU combine: `out = silu(gate) * up`, element-wise.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) -> Result<(), ShapeError> {
    check_len("swiglu up", up.len(), gate.len())?;
    check_len("swiglu out", out.len(), gate.len())?;
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = (f64::from(silu(g)) * f64::from(u)) as f32;
    }
    Ok(())
}

/// Tanh-gated residual in place: `x[r] += tanh(gate[row_mod[r]]) * y[r]`. `gate` is `[n_mod, cols]`.
pub fn gated_residual(
    x: &mut [f32],
    rows: usize,
    cols: usize,
    y: &[f32],
    gate: &[f32],
    n_mod: usize,
    row_mod: &[usize],
) -> Result<(), ShapeError> {
    residual_through_gate(
        "gated_residual",
        (x, rows, cols),
        y,
        (gate, n_mod, row_mod),
        f64::tanh,
    )
}

/// `x[r] += activation(gate[row_mod[r]]) * y[r]` in f64, the shared body of the gated residuals.
fn residual_through_gate(
    op: &str,
    (x, rows, cols): (&mut [f32], usize, usize),
    y: &[f32],
    (gate, n_mod, row_mod): (&[f32], usize, &[usize]),
    activation: impl Fn(f64) -> f64,
) -> Result<(), ShapeError> {
    let n = checked_product(&format!("{op} x"), &[rows, cols])?;
    check_len(&format!("{op} x"), x.len(), n)?;
    check_len(&format!("{op} y"), y.len(), n)?;
    check_len(
        &format!("{op} gate"),
        gate.len(),
        checked_product("gate", &[n_mod, cols])?,
    )?;
    check_row_mod(row_mod, rows, n_mod)?;
    if cols == 0 {
        return Ok(());
    }
    for ((x_row, y_row), &m) in x
        .chunks_exact_mut(cols)
        .zip(y.chunks_exact(cols))
        .zip(row_mod)
    {
        let g_row = &gate[m * cols..(m + 1) * cols];
        for ((xv, &yv), &g) in x_row.iter_mut().zip(y_row).zip(g_row) {
            *xv = (f64::from(*xv) + activation(f64::from(g)) * f64::from(yv)) as f32;
        }
    }
    Ok(())
}

/// Sinusoidal timestep embedding, cos first: for `t` in `timesteps` (in [0, 1]),
/// `args_i = (1000 t) * exp(-ln(10000) i / half)`, `out = [cos(args) | sin(args)]`, `half = dim / 2`
/// (an odd `dim` gets a trailing zero). Frequencies and arguments are rounded to f32 as the reference does.
pub fn timestep_embedding(
    timesteps: &[f32],
    dim: usize,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    check_len(
        "timestep_embedding out",
        out.len(),
        checked_product("out", &[timesteps.len(), dim])?,
    )?;
    let half = dim / 2;
    let neg_log = -(10000f64.ln()) as f32;
    let freqs: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (neg_log * i as f32) / half as f32;
            f64::from(exponent).exp() as f32
        })
        .collect();
    if dim == 0 {
        return Ok(());
    }
    for (&t, row) in timesteps.iter().zip(out.chunks_exact_mut(dim)) {
        let t = 1000.0f32 * t;
        for (i, &f) in freqs.iter().enumerate() {
            let arg = f64::from(t * f);
            row[i] = arg.cos() as f32;
            row[half + i] = arg.sin() as f32;
        }
        if dim % 2 == 1 {
            row[dim - 1] = 0.0;
        }
    }
    Ok(())
}

/// Cos/sin tables `[rows, head_dim / 2]` for rotate-half RoPE at positions `offset..offset + rows`: angle
/// `f32(pos) * inv_freq` rounded to f32 as the reference computes it.
pub fn rotate_half_tables(
    rows: usize,
    offset: usize,
    head_dim: usize,
    theta: f32,
) -> (Vec<f32>, Vec<f32>) {
    let inv = rope_inverse_frequencies(head_dim, theta);
    let mut cos = Vec::with_capacity(rows * inv.len());
    let mut sin = Vec::with_capacity(rows * inv.len());
    for r in 0..rows {
        let pos = (offset + r) as f32;
        for &f in &inv {
            let angle = f64::from(pos * f);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotate-half RoPE in place (the transformers layout): for each token and head, with `half = head_dim / 2`,
/// `(x[j], x[j + half]) -> (x[j] cos - x[j + half] sin, x[j + half] cos + x[j] sin)`, each product and sum
/// rounded to f32 as the reference's `q * cos + rotate_half(q) * sin` does. `x` is `[tokens, heads, head_dim]`,
/// tables `[tokens, head_dim / 2]`.
pub fn rope_rotate_half(
    x: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    cos: &[f32],
    sin: &[f32],
) -> Result<(), ShapeError> {
    // The whole head rotated, the tables as given: the partial form at full width computes exactly this.
    rope_rotate_half_partial(
        x,
        tokens,
        heads,
        head_dim,
        head_dim,
        cos,
        sin,
        RopeTableRounding::F32,
    )
}

/// Which statistics [`norm_modulate`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `(x - mean) / sqrt(var + eps)`.
    LayerNorm,
    /// `x / sqrt(mean(x^2) + eps)`.
    RmsNorm,
}

/// The optional parts of [`norm_modulate`]: a per-column affine `weight` (and `bias`), then per-row `(1 + scale)`
/// and `+ shift` from `[n_mod, cols]` tables, row `r` using row `row_mod[r]`.
#[derive(Clone, Copy, Debug)]
pub struct NormModulation<'a> {
    pub weight: Option<&'a [f32]>,
    pub bias: Option<&'a [f32]>,
    pub scale: Option<&'a [f32]>,
    pub shift: Option<&'a [f32]>,
    pub n_mod: usize,
    pub row_mod: &'a [usize],
}

/// LayerNorm or RMSNorm of each row of `x` (`[rows, cols]`), affine or not, optionally modulated:
/// `out = norm(x) (* weight (+ bias)) (* (1 + scale[m]) (+ shift[m]))` with `m = row_mod[r]`.
pub fn norm_modulate(
    x: &[f32],
    rows: usize,
    cols: usize,
    kind: NormKind,
    parts: NormModulation<'_>,
    eps: f32,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let n = checked_product("norm_modulate x", &[rows, cols])?;
    check_len("norm_modulate x", x.len(), n)?;
    check_len("norm_modulate out", out.len(), n)?;
    for (what, v) in [
        ("norm_modulate weight", parts.weight),
        ("norm_modulate bias", parts.bias),
    ] {
        if let Some(v) = v {
            check_len(what, v.len(), cols)?;
        }
    }
    let table = checked_product("norm_modulate scale", &[parts.n_mod, cols])?;
    for (what, v) in [
        ("norm_modulate scale", parts.scale),
        ("norm_modulate shift", parts.shift),
    ] {
        if let Some(v) = v {
            check_len(what, v.len(), table)?;
        }
    }
    if parts.scale.is_some() || parts.shift.is_some() {
        check_row_mod(parts.row_mod, rows, parts.n_mod)?;
    }
    if cols == 0 {
        return Ok(());
    }
    for (r, (x_row, out_row)) in x
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        let (mean, rstd) = match kind {
            NormKind::LayerNorm => mean_rstd(x_row, eps),
            NormKind::RmsNorm => {
                let ms = x_row
                    .iter()
                    .map(|&v| f64::from(v) * f64::from(v))
                    .sum::<f64>()
                    / cols as f64;
                (0.0, 1.0 / (ms + f64::from(eps)).sqrt())
            }
        };
        let m = parts.row_mod.get(r).copied().unwrap_or(0);
        for (c, (o, &v)) in out_row.iter_mut().zip(x_row).enumerate() {
            let mut y = (f64::from(v) - mean) * rstd;
            if let Some(w) = parts.weight {
                y *= f64::from(w[c]);
                if let Some(b) = parts.bias {
                    y += f64::from(b[c]);
                }
            }
            if let Some(s) = parts.scale {
                y *= 1.0 + f64::from(s[m * cols + c]);
            }
            if let Some(h) = parts.shift {
                y += f64::from(h[m * cols + c]);
            }
            *o = y as f32;
        }
    }
    Ok(())
}

/// How rotary cos/sin tables are rounded before use: a float32 run of a reference uses them as computed, a
/// bfloat16 run casts them to the activations' dtype first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RopeTableRounding {
    /// As given (f32).
    #[default]
    F32,
    /// Rounded to bf16 first.
    Bf16,
}

/// Rotate-half RoPE over the first `rotated` channels of each head (partial RoPE), in place; channels
/// `rotated..head_dim` pass through. Tables are `[tokens, rotated / 2]`, rounded as `rounding` says. Each product
/// and sum is rounded to f32 as [`rope_rotate_half`] does, so at full width with f32 tables the two agree bit for
/// bit.
#[allow(clippy::too_many_arguments)]
pub fn rope_rotate_half_partial(
    x: &mut [f32],
    tokens: usize,
    heads: usize,
    head_dim: usize,
    rotated: usize,
    cos: &[f32],
    sin: &[f32],
    rounding: RopeTableRounding,
) -> Result<(), ShapeError> {
    if rotated > head_dim || !rotated.is_multiple_of(2) {
        return Err(ShapeError::new(
            "rope_rotate_half_partial rotated",
            format!("an even width within 0..={head_dim}"),
            format!("{rotated}"),
        ));
    }
    let expected = checked_product("rope_rotate_half_partial x", &[tokens, heads, head_dim])?;
    check_len("rope_rotate_half_partial x", x.len(), expected)?;
    let half = rotated / 2;
    let table = checked_product("rope_rotate_half_partial tables", &[tokens, half])?;
    check_len("rope_rotate_half_partial cos", cos.len(), table)?;
    check_len("rope_rotate_half_partial sin", sin.len(), table)?;
    if head_dim == 0 || heads == 0 || half == 0 {
        return Ok(());
    }
    let round = |v: f32| match rounding {
        RopeTableRounding::F32 => v,
        RopeTableRounding::Bf16 => half::bf16::from_f32(v).to_f32(),
    };
    for (t, token) in x.chunks_exact_mut(heads * head_dim).enumerate() {
        for head in token.chunks_exact_mut(head_dim) {
            let (lo, hi) = head[..rotated].split_at_mut(half);
            for (j, (a, b)) in lo.iter_mut().zip(hi.iter_mut()).enumerate() {
                let (c, s) = (round(cos[t * half + j]), round(sin[t * half + j]));
                let (x1, x2) = (*a, *b);
                *a = x1 * c + (-x2) * s;
                *b = x2 * c + x1 * s;
            }
        }
    }
    Ok(())
}

/// SwiGLU of a fused `[rows, 2 * hidden]` matrix: `out[r, c] = silu(gate) * value`, the gate half first
/// (`gate_first`, `[gate | value]`) or second (`[value | gate]`).
pub fn swiglu_fused(
    fused: &[f32],
    rows: usize,
    hidden: usize,
    gate_first: bool,
    out: &mut [f32],
) -> Result<(), ShapeError> {
    let n = checked_product("swiglu_fused out", &[rows, hidden])?;
    check_len(
        "swiglu_fused fused",
        fused.len(),
        checked_product("swiglu_fused", &[n, 2])?,
    )?;
    check_len("swiglu_fused out", out.len(), n)?;
    if hidden == 0 {
        return Ok(());
    }
    for (row, o) in fused
        .chunks_exact(2 * hidden)
        .zip(out.chunks_exact_mut(hidden))
    {
        let (first, second) = row.split_at(hidden);
        let (gate, value) = if gate_first {
            (first, second)
        } else {
            (second, first)
        };
        swiglu(gate, value, o)?;
    }
    Ok(())
}

/// Adds `bias` (`[cols]`) to every row of `x` (`[rows, cols]`) in place: the bias of a linear layer.
pub fn add_bias(x: &mut [f32], rows: usize, cols: usize, bias: &[f32]) -> Result<(), ShapeError> {
    check_len(
        "add_bias x",
        x.len(),
        checked_product("add_bias x", &[rows, cols])?,
    )?;
    check_len("add_bias bias", bias.len(), cols)?;
    if cols == 0 {
        return Ok(());
    }
    for row in x.chunks_exact_mut(cols) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
    Ok(())
}

/// Plain gated residual in place, `x[r] += gate[row_mod[r]] * y[r]` (no tanh, unlike [`gated_residual`]).
/// `gate` is `[n_mod, cols]`.
pub fn gate_residual(
    x: &mut [f32],
    rows: usize,
    cols: usize,
    y: &[f32],
    gate: &[f32],
    n_mod: usize,
    row_mod: &[usize],
) -> Result<(), ShapeError> {
    residual_through_gate(
        "gate_residual",
        (x, rows, cols),
        y,
        (gate, n_mod, row_mod),
        |g| g,
    )
}

/// Sinusoidal embedding of unscaled values, cos first: for `v` in `values`,
/// `args_i = v * exp(-ln(10000) i / half)`, `out = [cos(args) | sin(args)]`, `half = dim / 2` (an odd `dim` gets a
/// trailing zero). Frequencies and arguments are rounded to f32 as the reference does; [`timestep_embedding`] is
/// this function at `1000 t`.
pub fn sinusoidal_embedding(values: &[f32], dim: usize, out: &mut [f32]) -> Result<(), ShapeError> {
    check_len(
        "sinusoidal_embedding out",
        out.len(),
        checked_product("out", &[values.len(), dim])?,
    )?;
    let half = dim / 2;
    let neg_log = -(10000f64.ln()) as f32;
    let freqs: Vec<f32> = (0..half)
        .map(|i| f64::from((neg_log * i as f32) / half as f32).exp() as f32)
        .collect();
    if dim == 0 {
        return Ok(());
    }
    for (&v, row) in values.iter().zip(out.chunks_exact_mut(dim)) {
        for (i, &f) in freqs.iter().enumerate() {
            let arg = f64::from(v * f);
            row[i] = arg.cos() as f32;
            row[half + i] = arg.sin() as f32;
        }
        if dim % 2 == 1 {
            row[dim - 1] = 0.0;
        }
    }
    Ok(())
}

/// Geometry of a 1-D convolution over `[batch, channels, length]` rows, as PyTorch's `Conv1d` and
/// `ConvTranspose1d` take it (zero `padding` on both sides; no output padding for the transposed form).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Conv1dGeometry {
    pub in_channels: usize,
    pub out_channels: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
    pub dilation: usize,
    pub groups: usize,
}

impl Conv1dGeometry {
    /// A stride-1, dilation-1, ungrouped convolution.
    pub fn plain(in_channels: usize, out_channels: usize, kernel: usize, padding: usize) -> Self {
        Conv1dGeometry {
            in_channels,
            out_channels,
            kernel,
            stride: 1,
            padding,
            dilation: 1,
            groups: 1,
        }
    }

    fn check(&self, what: &str) -> Result<(usize, usize), ShapeError> {
        let g = self.groups;
        if g == 0
            || self.kernel == 0
            || self.stride == 0
            || self.dilation == 0
            || !self.in_channels.is_multiple_of(g)
            || !self.out_channels.is_multiple_of(g)
            || self.in_channels == 0
            || self.out_channels == 0
        {
            return Err(ShapeError::new(
                what,
                "positive channels, kernel, stride and dilation, channels divisible by groups",
                format!("{self:?}"),
            ));
        }
        Ok((self.in_channels / g, self.out_channels / g))
    }

    /// Span of the dilated kernel: `dilation * (kernel - 1) + 1`.
    fn span(&self, what: &str) -> Result<usize, ShapeError> {
        self.dilation
            .checked_mul(self.kernel - 1)
            .and_then(|s| s.checked_add(1))
            .ok_or_else(|| ShapeError::new(what, "a kernel span that fits", format!("{self:?}")))
    }

    /// Output length of [`conv1d`] for an input of `len`: `(len + 2 padding - span) / stride + 1`.
    pub fn conv_out_len(&self, len: usize) -> Result<usize, ShapeError> {
        let span = self.span("conv1d")?;
        let padded = self
            .padding
            .checked_mul(2)
            .and_then(|p| p.checked_add(len))
            .ok_or_else(|| {
                ShapeError::new("conv1d", "a padded length that fits", format!("{len}"))
            })?;
        if padded < span {
            return Err(ShapeError::new(
                "conv1d input length",
                format!("at least {span} after padding"),
                format!("{padded}"),
            ));
        }
        Ok((padded - span) / self.stride + 1)
    }

    /// Output length of [`conv_transpose1d`]: `(len - 1) stride - 2 padding + span`.
    pub fn transpose_out_len(&self, len: usize) -> Result<usize, ShapeError> {
        let span = self.span("conv_transpose1d")?;
        let full = len
            .checked_sub(1)
            .and_then(|l| l.checked_mul(self.stride))
            .and_then(|l| l.checked_add(span))
            .ok_or_else(|| {
                ShapeError::new(
                    "conv_transpose1d input length",
                    "at least 1",
                    format!("{len}"),
                )
            })?;
        match full.checked_sub(self.padding.saturating_mul(2)) {
            Some(n) if n > 0 => Ok(n),
            _ => Err(ShapeError::new(
                "conv_transpose1d output length",
                "positive",
                format!("{full} - 2 x {}", self.padding),
            )),
        }
    }
}

/// `Conv1d` over `x` `[batch, in_channels, len]` with `weight` `[out_channels, in_channels / groups, kernel]` and an
/// optional `bias` `[out_channels]`; returns `[batch, out_channels, out_len]` and `out_len`. Sums in f64.
pub fn conv1d(
    x: &[f32],
    batch: usize,
    len: usize,
    geo: &Conv1dGeometry,
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Result<(Vec<f32>, usize), ShapeError> {
    let (cin_g, cout_g) = geo.check("conv1d")?;
    let out_len = geo.conv_out_len(len)?;
    check_len(
        "conv1d x",
        x.len(),
        checked_product("conv1d x", &[batch, geo.in_channels, len])?,
    )?;
    check_len(
        "conv1d weight",
        weight.len(),
        checked_product("conv1d weight", &[geo.out_channels, cin_g, geo.kernel])?,
    )?;
    if let Some(b) = bias {
        check_len("conv1d bias", b.len(), geo.out_channels)?;
    }
    let mut out = vec![0f32; checked_product("conv1d out", &[batch, geo.out_channels, out_len])?];
    let mut acc = vec![0f64; out_len];
    for b in 0..batch {
        for o in 0..geo.out_channels {
            acc.iter_mut().for_each(|a| *a = 0.0);
            let first_in = (o / cout_g) * cin_g;
            for ci in 0..cin_g {
                let row = &x[(b * geo.in_channels + first_in + ci) * len..][..len];
                let w = &weight[(o * cin_g + ci) * geo.kernel..][..geo.kernel];
                for (kk, &wk) in w.iter().enumerate() {
                    let wk = f64::from(wk);
                    let shift = kk * geo.dilation;
                    for (t, a) in acc.iter_mut().enumerate() {
                        // Input position t * stride + shift - padding, skipped in the zero padding.
                        let p = t * geo.stride + shift;
                        if p >= geo.padding && p - geo.padding < len {
                            *a += wk * f64::from(row[p - geo.padding]);
                        }
                    }
                }
            }
            let add = bias.map_or(0.0, |bv| bv[o]);
            let dst = &mut out[(b * geo.out_channels + o) * out_len..][..out_len];
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = a as f32 + add;
            }
        }
    }
    Ok((out, out_len))
}

/// `ConvTranspose1d` over `x` `[batch, in_channels, len]` with `weight` `[in_channels, out_channels / groups,
/// kernel]` and an optional `bias`; returns `[batch, out_channels, out_len]` and `out_len`. Sums in f64.
pub fn conv_transpose1d(
    x: &[f32],
    batch: usize,
    len: usize,
    geo: &Conv1dGeometry,
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Result<(Vec<f32>, usize), ShapeError> {
    let (cin_g, cout_g) = geo.check("conv_transpose1d")?;
    let out_len = geo.transpose_out_len(len)?;
    check_len(
        "conv_transpose1d x",
        x.len(),
        checked_product("conv_transpose1d x", &[batch, geo.in_channels, len])?,
    )?;
    check_len(
        "conv_transpose1d weight",
        weight.len(),
        checked_product(
            "conv_transpose1d weight",
            &[geo.in_channels, cout_g, geo.kernel],
        )?,
    )?;
    if let Some(b) = bias {
        check_len("conv_transpose1d bias", b.len(), geo.out_channels)?;
    }
    let n_out = checked_product("conv_transpose1d out", &[batch, geo.out_channels, out_len])?;
    let mut acc = vec![0f64; n_out];
    for b in 0..batch {
        for ci in 0..geo.in_channels {
            let row = &x[(b * geo.in_channels + ci) * len..][..len];
            let first_out = (ci / cin_g) * cout_g;
            for co in 0..cout_g {
                let w = &weight[(ci * cout_g + co) * geo.kernel..][..geo.kernel];
                let dst = &mut acc[(b * geo.out_channels + first_out + co) * out_len..][..out_len];
                for (t, &xv) in row.iter().enumerate() {
                    let xv = f64::from(xv);
                    for (kk, &wk) in w.iter().enumerate() {
                        // Output position t * stride + kk * dilation - padding, dropped outside [0, out_len).
                        let p = t * geo.stride + kk * geo.dilation;
                        if p >= geo.padding && p - geo.padding < out_len {
                            dst[p - geo.padding] += xv * f64::from(wk);
                        }
                    }
                }
            }
        }
    }
    let mut out: Vec<f32> = acc.iter().map(|&a| a as f32).collect();
    if let Some(bv) = bias {
        for (i, row) in out.chunks_exact_mut(out_len).enumerate() {
            let add = bv[i % geo.out_channels];
            row.iter_mut().for_each(|v| *v += add);
        }
    }
    Ok((out, out_len))
}

/// Pads every row of `x` (`[rows, len]`, `len >= 1`) by repeating its first value `left` times and its last value
/// `right` times (PyTorch's `replicate` padding); returns `[rows, left + len + right]`.
pub fn pad_replicate_1d(
    x: &[f32],
    rows: usize,
    len: usize,
    left: usize,
    right: usize,
) -> Result<Vec<f32>, ShapeError> {
    if len == 0 {
        return Err(ShapeError::new("pad_replicate_1d len", "at least 1", "0"));
    }
    check_len(
        "pad_replicate_1d x",
        x.len(),
        checked_product("pad_replicate_1d x", &[rows, len])?,
    )?;
    let width = len
        .checked_add(left)
        .and_then(|w| w.checked_add(right))
        .ok_or_else(|| {
            ShapeError::new(
                "pad_replicate_1d",
                "a padded length that fits",
                format!("{len}"),
            )
        })?;
    let mut out = Vec::with_capacity(checked_product("pad_replicate_1d out", &[rows, width])?);
    for row in x.chunks_exact(len) {
        out.extend(std::iter::repeat_n(row[0], left));
        out.extend_from_slice(row);
        out.extend(std::iter::repeat_n(row[len - 1], right));
    }
    Ok(out)
}

/// SnakeBeta in place over `x` `[batch, channels, len]`: `x + sin(exp(alpha_c) x)^2 / (exp(beta_c) + 1e-9)`, with
/// `alpha` and `beta` the per-channel log-space parameters, all in f32 as the reference computes it.
pub fn snake_beta(
    x: &mut [f32],
    batch: usize,
    channels: usize,
    len: usize,
    alpha: &[f32],
    beta: &[f32],
) -> Result<(), ShapeError> {
    check_len(
        "snake_beta x",
        x.len(),
        checked_product("snake_beta x", &[batch, channels, len])?,
    )?;
    check_len("snake_beta alpha", alpha.len(), channels)?;
    check_len("snake_beta beta", beta.len(), channels)?;
    if len == 0 {
        return Ok(());
    }
    for (i, row) in x.chunks_exact_mut(len).enumerate() {
        let c = i % channels;
        let freq = alpha[c].exp();
        let inv_mag = 1.0f32 / (beta[c].exp() + 1e-9f32);
        for v in row.iter_mut() {
            let s = (freq * *v).sin();
            *v += inv_mag * (s * s);
        }
    }
    Ok(())
}

/// Weight normalization (`torch.nn.utils.weight_norm`, `dim = 0`): `w[i] = v[i] * (g[i] / ||v[i]||)` for each of
/// the `rows` leading slices of `v` (`[rows, ...]`, flattened), with `g` `[rows]`. The norm sums in f64.
pub fn weight_norm(v: &[f32], g: &[f32], rows: usize) -> Result<Vec<f32>, ShapeError> {
    check_len("weight_norm g", g.len(), rows)?;
    if rows == 0 || !v.len().is_multiple_of(rows) || v.is_empty() {
        return Err(ShapeError::new(
            "weight_norm v",
            format!("a positive multiple of {rows} elements"),
            format!("{}", v.len()),
        ));
    }
    let per = v.len() / rows;
    let mut out = vec![0f32; v.len()];
    // Rows are independent: a large weight is split over the host's threads (the same values).
    for_row_runs(&mut out, per, v.len() >= 1 << 20, |first, out_rows| {
        for ((row, &gi), out_row) in v[first * per..]
            .chunks_exact(per)
            .zip(&g[first..])
            .zip(out_rows.chunks_exact_mut(per))
        {
            let norm = row
                .iter()
                .map(|&a| f64::from(a) * f64::from(a))
                .sum::<f64>()
                .sqrt() as f32;
            let scale = gi / norm;
            for (o, &a) in out_row.iter_mut().zip(row) {
                *o = a * scale;
            }
        }
    });
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol)
    }

    #[test]
    fn linear_is_x_times_w_transposed() {
        // x [2,3], w [2,3] -> out [2,2]
        let x = [1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
        let w = [1.0, 0.0, 0.0, 0.5, 0.5, 0.5];
        let mut out = [0.0; 4];
        linear(&x, 2, 3, &w, 2, &mut out).unwrap();
        assert_eq!(out, [1.0, 3.0, -1.0, 0.0]);
        assert!(linear(&x, 2, 3, &w, 3, &mut out).is_err());
    }

    #[test]
    fn linear_threaded_matches_single_thread() {
        let (rows, inf, outf) = (67, 129, 130);
        let x: Vec<f32> = (0..rows * inf)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let w: Vec<f32> = (0..outf * inf)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 48.0)
            .collect();
        let mut big = vec![0.0; rows * outf];
        linear(&x, rows, inf, &w, outf, &mut big).unwrap();
        for r in [0, 33, 66] {
            let mut one = vec![0.0; outf];
            linear(&x[r * inf..(r + 1) * inf], 1, inf, &w, outf, &mut one).unwrap();
            assert_eq!(&big[r * outf..(r + 1) * outf], one.as_slice());
        }
    }

    #[test]
    fn layer_norm_modulate_by_hand() {
        // Row [1, 3]: mean 2, var 1 -> normalized [-1, 1] (eps 0); scales pick row 1 = [1, -0.5].
        let mut out = [0.0; 2];
        let scale = [0.0, 0.0, 1.0, -0.5];
        layer_norm_modulate(&[1.0, 3.0], 1, 2, &scale, 2, &[1], 0.0, &mut out).unwrap();
        assert!(close(&out, &[-2.0, 0.5], 1e-6), "{out:?}");
        assert!(layer_norm_modulate(&[1.0, 3.0], 1, 2, &scale, 2, &[2], 0.0, &mut out).is_err());
    }

    #[test]
    fn rms_norms_by_hand() {
        // [3, 4]: mean square 12.5, rms = 3.5355.
        let mut out = [0.0; 2];
        rms_norm(&[3.0, 4.0], 1, 2, &[1.0, 2.0], 0.0, &mut out).unwrap();
        let r = 12.5f32.sqrt();
        assert!(close(&out, &[3.0 / r, 8.0 / r], 1e-6));
        rms_norm_zero_centred(&[3.0, 4.0], 1, 2, &[0.0, 1.0], 0.0, &mut out).unwrap();
        assert!(close(&out, &[3.0 / r, 8.0 / r], 1e-6));
    }

    #[test]
    fn rope_rotates_pairs() {
        // One token, one head, 4 channels = 2 pairs; rotate pair 0 by 90 degrees, pair 1 by 0.
        let mut x = [1.0, 0.0, 2.0, 3.0];
        rope_interleaved(&mut x, 1, 1, 4, &[0.0, 1.0], &[1.0, 0.0]).unwrap();
        assert!(close(&x, &[0.0, 1.0, 2.0, 3.0], 1e-7));
    }

    #[test]
    fn rope_tables_follow_positions_per_axis() {
        // Axes dims (2, 2, 4): inverse frequencies [1], [1], [1, 1/100].
        let (cos, sin) = rope_tables(&[[0, 1, -2]], [2, 2, 4], 10000.0);
        assert_eq!(cos.len(), 4);
        assert!(close(
            &cos,
            &[1.0, 1f32.cos(), (-2f32).cos(), (-0.02f32).cos()],
            1e-6
        ));
        assert!(close(
            &sin,
            &[0.0, 1f32.sin(), (-2f32).sin(), (-0.02f32).sin()],
            1e-6
        ));
    }

    /// The tables as one trigonometric call per entry (what the per-axis reuse must equal bit for bit).
    fn rope_tables_direct(
        positions: &[[i64; 3]],
        axes_dims: [usize; 3],
        theta: f32,
    ) -> (Vec<f32>, Vec<f32>) {
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for pos in positions {
            for (axis, &d) in axes_dims.iter().enumerate() {
                for f in rope_inverse_frequencies(d, theta) {
                    let (c, s) = rope_entry(pos[axis], f);
                    cos.push(c);
                    sin.push(s);
                }
            }
        }
        (cos, sin)
    }

    proptest::proptest! {
        /// Reused per-axis rows give the bits of the direct computation, for grids (ranges shorter than the
        /// tokens), scattered values (longer ranges) and extreme values (no table).
        #[test]
        fn rope_tables_reuse_gives_the_direct_bits(
            positions in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::array::uniform3(-40i64..40),
                    proptest::array::uniform3(-100_000i64..100_000),
                    proptest::array::uniform3(proptest::prelude::any::<i64>()),
                ],
                0..200,
            ),
            halves in proptest::array::uniform3(0usize..5),
        ) {
            let dims = halves.map(|h| 2 * h);
            let positions: Vec<[i64; 3]> = positions;
            let fast = rope_tables(&positions, dims, 10000.0);
            let direct = rope_tables_direct(&positions, dims, 10000.0);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            proptest::prop_assert_eq!(bits(&fast.0), bits(&direct.0));
            proptest::prop_assert_eq!(bits(&fast.1), bits(&direct.1));
        }
    }

    #[test]
    fn attention_block_causal_and_padding() {
        // 3 positions, 1 head, dim 1; keys [0, 1, 2] with values [1, 2, 4]; equal scores (q = 0).
        let q = [0.0, 0.0, 0.0];
        let k = [1.0, 1.0, 1.0];
        let v = [1.0, 2.0, 4.0];
        let mut out = [0.0; 3];
        // Text, then an image block of 2: position 1 sees 0..=2 (same block), position 0 only itself.
        let mask = AttentionMask {
            q_offset: 0,
            block_ids: &[-1, 0, 0],
            key_valid: &[true, true, true],
        };
        attention(&q, &k, &v, 3, 3, 1, 1, mask, &mut out).unwrap();
        assert!(close(&out, &[1.0, 7.0 / 3.0, 7.0 / 3.0], 1e-6), "{out:?}");
        // All text: strictly causal; key 1 padded.
        let mask = AttentionMask {
            q_offset: 0,
            block_ids: &[-1, -1, -1],
            key_valid: &[true, false, true],
        };
        attention(&q, &k, &v, 3, 3, 1, 1, mask, &mut out).unwrap();
        assert!(close(&out, &[1.0, 1.0, 2.5], 1e-6), "{out:?}");
        // Cached mode: one query at position 2 over all keys.
        let mask = AttentionMask {
            q_offset: 2,
            block_ids: &[-1, -1, 0],
            key_valid: &[true, true, true],
        };
        let mut one = [0.0];
        attention(&[0.0], &k, &v, 1, 3, 1, 1, mask, &mut one).unwrap();
        assert!(close(&one, &[7.0 / 3.0], 1e-6));
    }

    #[test]
    fn attention_softmax_weights_scores() {
        // dim 4 -> scale 1/2. q.k = [0, 2] -> scores [0, 1] -> weights [1, e] / (1 + e).
        let q = [1.0, 1.0, 0.0, 0.0];
        let k = [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0];
        let v = [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        let mask = AttentionMask {
            q_offset: 1,
            block_ids: &[-1, -1],
            key_valid: &[true, true],
        };
        attention(&q, &k, &v, 1, 2, 1, 4, mask, &mut out).unwrap();
        let e = std::f32::consts::E;
        assert!(close(&out, &[e / (1.0 + e), 0.0, 0.0, 0.0], 1e-6));
    }

    #[test]
    fn activations_by_hand() {
        assert_eq!(silu(0.0), 0.0);
        assert!((silu(1.0) - 1.0 / (1.0 + (-1f32).exp())).abs() < 1e-7);
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        let mut out = [0.0; 2];
        swiglu(&[1.0, 0.0], &[2.0, 5.0], &mut out).unwrap();
        assert!(close(&out, &[2.0 * silu(1.0), 0.0], 1e-7));
    }

    #[test]
    fn gated_residual_by_hand() {
        let mut x = [1.0, 1.0];
        gated_residual(&mut x, 1, 2, &[2.0, 2.0], &[0.0, 100.0], 1, &[0]).unwrap();
        assert!(close(&x, &[1.0, 3.0], 1e-6));
    }

    #[test]
    fn timestep_embedding_cos_first() {
        let mut out = [0.0; 4];
        timestep_embedding(&[0.0], 4, &mut out).unwrap();
        assert_eq!(out, [1.0, 1.0, 0.0, 0.0]);
        // half = 2: freqs [1, 1/100]; t = 0.001 -> 1000 t = 1.
        timestep_embedding(&[0.001], 4, &mut out).unwrap();
        assert!(
            close(
                &out,
                &[1f32.cos(), 0.01f32.cos(), 1f32.sin(), 0.01f32.sin()],
                1e-6
            ),
            "{out:?}"
        );
    }

    #[test]
    fn add_bias_adds_per_column() {
        let mut x = vec![1.0, 2.0, 3.0, 4.0];
        add_bias(&mut x, 2, 2, &[0.5, -1.0]).unwrap();
        assert_eq!(x, vec![1.5, 1.0, 3.5, 3.0]);
        assert!(add_bias(&mut x, 2, 2, &[0.5]).is_err());
    }

    #[test]
    fn gate_residual_is_plain_and_per_row() {
        let mut x = vec![1.0, 1.0, 1.0, 1.0];
        let y = vec![2.0, 3.0, 4.0, 5.0];
        let gate = vec![0.5, 0.5, -1.0, 2.0];
        gate_residual(&mut x, 2, 2, &y, &gate, 2, &[1, 0]).unwrap();
        assert_eq!(x, vec![-1.0, 7.0, 3.0, 3.5]);
        assert!(gate_residual(&mut x, 2, 2, &y, &gate, 2, &[2, 0]).is_err());
    }

    #[test]
    fn sinusoidal_embedding_is_the_unscaled_timestep_embedding() {
        let t = [0.0f32, 0.25, 0.999];
        let mut a = vec![0f32; 3 * 8];
        let mut b = vec![0f32; 3 * 8];
        timestep_embedding(&t, 8, &mut a).unwrap();
        let scaled: Vec<f32> = t.iter().map(|&v| 1000.0f32 * v).collect();
        sinusoidal_embedding(&scaled, 8, &mut b).unwrap();
        assert_eq!(a, b);
        sinusoidal_embedding(&[0.5], 8, &mut b[..8]).unwrap();
        assert_eq!(b[0], 0.5f32.cos());
        assert!((b[4] - 0.5f32.sin()).abs() < 1e-7);
        assert!(sinusoidal_embedding(&[0.5], 8, &mut b[..7]).is_err());
    }

    #[test]
    fn conv1d_by_hand_with_padding_dilation_stride_and_groups() {
        // One channel, kernel [1, 2], padding 1: [0 1 2 3 0] -> [0+2, 1+4, 2+6, 3+0] + bias.
        let geo = Conv1dGeometry::plain(1, 1, 2, 1);
        let (y, n) = conv1d(&[1.0, 2.0, 3.0], 1, 3, &geo, &[1.0, 2.0], Some(&[0.5])).unwrap();
        assert_eq!((y, n), (vec![2.5, 5.5, 8.5, 3.5], 4));
        // Dilation 2, stride 2 over [1..6]: taps (x[t*2], x[t*2+2]) weighted 1 and -1.
        let geo = Conv1dGeometry {
            stride: 2,
            dilation: 2,
            ..Conv1dGeometry::plain(1, 1, 2, 0)
        };
        let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let (y, n) = conv1d(&x, 1, 6, &geo, &[1.0, -1.0], None).unwrap();
        assert_eq!((y, n), (vec![-2.0, -2.0], 2));
        // Depthwise: two channels, each scaled by its own tap.
        let geo = Conv1dGeometry {
            groups: 2,
            ..Conv1dGeometry::plain(2, 2, 1, 0)
        };
        let (y, _) = conv1d(&[1.0, 2.0, 3.0, 4.0], 1, 2, &geo, &[2.0, -1.0], None).unwrap();
        assert_eq!(y, vec![2.0, 4.0, -3.0, -4.0]);
        assert!(conv1d(
            &x,
            1,
            6,
            &Conv1dGeometry::plain(1, 1, 9, 0),
            &[0.0; 9],
            None
        )
        .is_err());
        assert!(conv1d(&x, 1, 5, &geo, &[1.0, -1.0], None).is_err());
    }

    #[test]
    fn conv_transpose1d_is_the_adjoint_of_conv1d() {
        // <conv(x), y> == <x, conv_transpose(y)> for the same weight and geometry.
        let geo = Conv1dGeometry {
            stride: 3,
            padding: 1,
            dilation: 2,
            ..Conv1dGeometry::plain(2, 3, 3, 1)
        };
        let x: Vec<f32> = (0..2 * 9).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        let w: Vec<f32> = (0..3 * 2 * 3)
            .map(|i| ((i * 3) % 7) as f32 * 0.25 - 0.5)
            .collect();
        let (cx, n) = conv1d(&x, 1, 9, &geo, &w, None).unwrap();
        let y: Vec<f32> = (0..3 * n).map(|i| ((i * 5) % 3) as f32 - 1.0).collect();
        let t_geo = Conv1dGeometry {
            in_channels: 3,
            out_channels: 2,
            ..geo
        };
        let (ty, m) = conv_transpose1d(&y, 1, n, &t_geo, &w, None).unwrap();
        assert_eq!(m, 9);
        let lhs: f32 = cx.iter().zip(&y).map(|(a, b)| a * b).sum();
        let rhs: f32 = (0..2)
            .flat_map(|c| (0..m).map(move |t| (c, t)))
            .map(|(c, t)| x[c * 9 + t] * ty[c * m + t])
            .sum();
        assert!((lhs - rhs).abs() < 1e-4, "{lhs} vs {rhs}");
        // By hand: stride 2, kernel [1, 1, 1], padding 1 over [1, 2] -> [1, 1+2, 2, 2] cropped to 3 + bias.
        let g = Conv1dGeometry {
            stride: 2,
            ..Conv1dGeometry::plain(1, 1, 3, 1)
        };
        let (y, n) = conv_transpose1d(&[1.0, 2.0], 1, 2, &g, &[1.0; 3], Some(&[1.0])).unwrap();
        assert_eq!((y, n), (vec![2.0, 4.0, 3.0], 3));
        assert!(conv_transpose1d(
            &[1.0],
            1,
            1,
            &Conv1dGeometry::plain(1, 1, 1, 1),
            &[1.0],
            None
        )
        .is_err());
    }

    #[test]
    fn replicate_pad_snake_beta_and_weight_norm_by_hand() {
        let p = pad_replicate_1d(&[1.0, 2.0, 3.0, 4.0], 2, 2, 2, 1).unwrap();
        assert_eq!(p, vec![1.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 4.0, 4.0]);
        assert!(pad_replicate_1d(&[], 2, 0, 1, 1).is_err());
        let mut x = vec![0.5f32, -1.0];
        snake_beta(&mut x, 1, 2, 1, &[0.0, 2f32.ln()], &[0.0, 0.5f32.ln()]).unwrap();
        assert!((x[0] - (0.5 + 0.5f32.sin().powi(2))).abs() < 1e-6);
        assert!((x[1] - (-1.0 + 2.0 * 2f32.sin().powi(2))).abs() < 1e-6);
        assert!(snake_beta(&mut x, 1, 2, 1, &[0.0], &[0.0, 0.0]).is_err());
        let w = weight_norm(&[3.0, 4.0, 0.0, 2.0], &[10.0, -1.0], 2).unwrap();
        assert_eq!(w, vec![6.0, 8.0, 0.0, -1.0]);
        assert!(weight_norm(&[1.0, 2.0, 3.0], &[1.0, 1.0], 2).is_err());
    }

    /// Every row reaches `work` once, with its own index, on one thread or split unevenly over several.
    #[test]
    fn row_runs_cover_every_row_once_with_its_index() {
        for (rows, row_len, parallel) in [
            (0, 3, true),
            (1, 3, true),
            (7, 3, true),
            (1000, 5, true),
            (7, 3, false),
        ] {
            let mut out = vec![usize::MAX; rows * row_len];
            for_row_runs(&mut out, row_len, parallel, |first, run| {
                for (i, v) in run.iter_mut().enumerate() {
                    *v = first + i / row_len;
                }
            });
            for (r, row) in out.chunks_exact(row_len).enumerate() {
                assert!(
                    row.iter().all(|&v| v == r),
                    "{rows} rows, parallel {parallel}: row {r} got {row:?}"
                );
            }
        }
    }

    /// A weight large enough to be split over threads (an uneven split) gives each row's one-thread values.
    #[test]
    fn weight_norm_split_over_threads_keeps_every_row() {
        let (rows, per) = (1027usize, 1031usize);
        let v: Vec<f32> = (0..rows * per)
            .map(|i| ((i * 7919 % 1000) as f32 - 499.5) * 1e-3)
            .collect();
        let g: Vec<f32> = (0..rows).map(|i| 0.5 + i as f32 * 1e-3).collect();
        assert!(v.len() >= 1 << 20);
        let w = weight_norm(&v, &g, rows).unwrap();
        for (r, (row, out)) in v.chunks_exact(per).zip(w.chunks_exact(per)).enumerate() {
            let one = weight_norm(row, &g[r..=r], 1).unwrap();
            assert!(
                one.iter().zip(out).all(|(a, b)| a.to_bits() == b.to_bits()),
                "row {r}"
            );
        }
    }
}
