//! fp64 CPU reference of the whole expert path (forward and backward) and comparison helpers,
//! shared by the expert-path tests.
#![allow(dead_code)]

use half::{bf16, f16};
use rand::{rngs::StdRng, Rng};

/// Shapes of one layer: E experts, model width H, FFN width F, k routes per token.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub e: usize,
    pub h: usize,
    pub f: usize,
    pub k: usize,
}

/// Reference outputs, sized like the GPU buffers: y, dx `[T_max, H]`, dprobs `[T_max, k]`,
/// dw1 `[E, 2F, H]`, dw2 `[E, H, F]` (the gradients alone, without any accumulation base).
pub struct Reference {
    pub y: Vec<f64>,
    pub dx: Vec<f64>,
    pub dprobs: Vec<f64>,
    pub dw1: Vec<f64>,
    pub dw2: Vec<f64>,
}

pub fn bf(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

/// `n` values drawn uniformly from `[-scale, scale)`, rounded to bf16.
pub fn random_bf16(rng: &mut StdRng, n: usize, scale: f32) -> Vec<bf16> {
    bf(&(0..n).map(|_| rng.random_range(-scale..scale)).collect::<Vec<_>>())
}

pub fn f64s(v: &[bf16]) -> Vec<f64> {
    v.iter().map(|x| x.to_f64()).collect()
}

/// fp64 reference of forward and backward for the first `t` tokens of `x`, `dy`
/// (`[T_max, H]`), routed by `ids` / `probs` (`[T_max, k]`, id -1 = no route) to experts with
/// weights `w1 [E, 2F, H]`, `w2 [E, H, F]`. Intermediates the GPU stores in bf16 (h, act, fc2
/// rows, their gradients) are rounded to bf16 here too, so the comparison measures the kernels'
/// arithmetic rather than bf16 storage.
#[allow(clippy::too_many_arguments)]
pub fn reference(
    d: Dims,
    t: usize,
    ids: &[i32],
    probs: &[f32],
    x: &[bf16],
    dy: &[bf16],
    w1: &[bf16],
    w2: &[bf16],
) -> Reference {
    let r = |v: f64| bf16::from_f64(v).to_f64();
    reference_rounded(d, t, ids, probs, [&f64s(x), &f64s(dy), &f64s(w1), &f64s(w2)], r)
}

/// [`reference`] for f16 data: inputs widened from f16, intermediates rounded to f16.
#[allow(clippy::too_many_arguments)]
pub fn reference_f16(
    d: Dims,
    t: usize,
    ids: &[i32],
    probs: &[f32],
    x: &[f16],
    dy: &[f16],
    w1: &[f16],
    w2: &[f16],
) -> Reference {
    let wide = |v: &[f16]| v.iter().map(|x| x.to_f64()).collect::<Vec<f64>>();
    let r = |v: f64| f16::from_f64(v).to_f64();
    reference_rounded(d, t, ids, probs, [&wide(x), &wide(dy), &wide(w1), &wide(w2)], r)
}

/// The reference's arithmetic on `[x, dy, w1, w2]` widened to f64; `r` rounds an
/// intermediate to the 16-bit type the GPU stores it in.
fn reference_rounded(
    d: Dims,
    t: usize,
    ids: &[i32],
    probs: &[f32],
    [x, dy, w1, w2]: [&[f64]; 4],
    r: impl Fn(f64) -> f64,
) -> Reference {
    let Dims { e: ne, h: hh, f: ff, k: kk } = d;
    let t_max = x.len() / hh;
    let mut out = Reference {
        y: vec![0.0; t_max * hh],
        dx: vec![0.0; t_max * hh],
        dprobs: vec![0.0; t_max * kk],
        dw1: vec![0.0; ne * 2 * ff * hh],
        dw2: vec![0.0; ne * hh * ff],
    };
    let sigmoid = |g: f64| 1.0 / (1.0 + (-g).exp());
    for tok in 0..t {
        for j in 0..kk {
            let e = ids[tok * kk + j];
            if e < 0 {
                continue;
            }
            let e = e as usize;
            let p = probs[tok * kk + j] as f64;
            let xt = &x[tok * hh..(tok + 1) * hh];
            let w1e = &w1[e * 2 * ff * hh..(e + 1) * 2 * ff * hh];
            let w2e = &w2[e * hh * ff..(e + 1) * hh * ff];
            let h: Vec<f64> = (0..2 * ff).map(|o| r((0..hh).map(|c| w1e[o * hh + c] * xt[c]).sum())).collect();
            let act: Vec<f64> = (0..ff).map(|f| r(h[f] * sigmoid(h[f]) * h[ff + f])).collect();
            let o_rows: Vec<f64> = (0..hh).map(|o| r((0..ff).map(|f| w2e[o * ff + f] * act[f]).sum())).collect();
            let dyt = &dy[tok * hh..(tok + 1) * hh];
            for o in 0..hh {
                out.y[tok * hh + o] += p * o_rows[o];
            }
            out.dprobs[tok * kk + j] = (0..hh).map(|o| dyt[o] * o_rows[o]).sum();
            let dout: Vec<f64> = dyt.iter().map(|dv| r(p * dv)).collect();
            let mut dact = vec![0.0; ff];
            for o in 0..hh {
                for f in 0..ff {
                    out.dw2[(e * hh + o) * ff + f] += dout[o] * act[f];
                    dact[f] += w2e[o * ff + f] * dout[o];
                }
            }
            let dact: Vec<f64> = dact.into_iter().map(&r).collect();
            let mut dh = vec![0.0; 2 * ff];
            for f in 0..ff {
                let (g, u, sg) = (h[f], h[ff + f], sigmoid(h[f]));
                dh[f] = dact[f] * u * sg * (1.0 + g * (1.0 - sg));
                dh[ff + f] = dact[f] * g * sg;
            }
            let dh: Vec<f64> = dh.into_iter().map(&r).collect();
            let mut drow_in = vec![0.0; hh];
            for o in 0..2 * ff {
                for c in 0..hh {
                    out.dw1[(e * 2 * ff + o) * hh + c] += dh[o] * xt[c];
                    drow_in[c] += w1e[o * hh + c] * dh[o];
                }
            }
            for c in 0..hh {
                out.dx[tok * hh + c] += r(drow_in[c]);
            }
        }
    }
    out
}

/// Normwise relative error `|got - want| / |want| <= tol`; NaN or inf never passes.
pub fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: non-finite {g} at {i} (expected {w})");
        diff += (g - w) * (g - w);
        norm += w * w;
    }
    if norm == 0.0 {
        assert!(diff == 0.0, "{what}: expected all zeros");
        return;
    }
    let rel = (diff / norm).sqrt();
    assert!(rel <= tol, "{what}: normwise relative error {rel:.3e} > {tol:.0e}");
}

/// A bound on how far two fp32 evaluations of SwiGLU's backward (`csrc/common/swiglu_math.cuh`
/// against an f32/f64 reference) may drift apart at one element, from the terms' magnitudes:
/// absolute, since `1 + g (1 - s)` cancels near g = -1.28; the exp implementations differ by a
/// few fp32 ulps, far below the 1e-5 used here.
pub fn swiglu_backward_fp32_error(dact: f64, g: f64, u: f64) -> f64 {
    1e-5 * dact.abs() * (u.abs() * (1.0 + g.abs()) + g.abs())
}

/// One ulp at `v` of a 16-bit float with `mantissa` significand bits below the leading one
/// (7: bf16, 10: f16); the subnormal spacing for tiny values.
pub fn ulp16(v: f64, mantissa: i32) -> f64 {
    let min_exp = if mantissa == 7 { -126 } else { -14 };
    let exp = if v == 0.0 { min_exp } else { (v.abs().log2().floor() as i32).max(min_exp) };
    2f64.powi(exp - mantissa)
}

/// Bit-for-bit equality, reporting the first differing index.
pub fn assert_bits<B: PartialEq + std::fmt::Debug>(what: &str, got: &[B], want: &[B]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        let n = got.iter().zip(want).filter(|(a, b)| a != b).count();
        panic!("{what}: {n} of {} elements differ; first at {i}: got {:?}, expected {:?}", got.len(), got[i], want[i]);
    }
}

/// Poison written into an output before a run: a quiet NaN no kernel computes (CUDA's own
/// NaNs are 0x7FFF / 0x7FFFFFFF), so an element still holding it was not written.
pub const POISON_BF16: u16 = 0x7FC0;
/// The fp32 form of [`POISON_BF16`].
pub const POISON_F32: u32 = 0x7FC0_0000;
/// The f16 poison (f16's canonical CUDA NaN is 0x7FFF too).
pub const POISON_F16: u16 = 0x7E01;

pub fn poison_bf16(n: usize) -> Vec<bf16> {
    vec![bf16::from_bits(POISON_BF16); n]
}

pub fn poison_f32(n: usize) -> Vec<f32> {
    vec![f32::from_bits(POISON_F32); n]
}

pub fn poison_f16(n: usize) -> Vec<f16> {
    vec![f16::from_bits(POISON_F16); n]
}

/// Elements `[0, written)` were written (finite: a NaN left means unwritten or a NaN result),
/// elements `[written, len)` still hold the poison bit for bit (not written).
pub fn assert_written_bf16(what: &str, got: &[bf16], written: usize) {
    assert_written(
        what,
        &got.iter().map(|b| (b.is_finite(), b.to_bits() == POISON_BF16, b.to_bits() as u32)).collect::<Vec<_>>(),
        written,
    );
}

/// [`assert_written_bf16`] for f16 outputs.
pub fn assert_written_f16(what: &str, got: &[f16], written: usize) {
    assert_written(
        what,
        &got.iter().map(|b| (b.is_finite(), b.to_bits() == POISON_F16, b.to_bits() as u32)).collect::<Vec<_>>(),
        written,
    );
}

/// [`assert_written_bf16`] for fp32 outputs.
pub fn assert_written_f32(what: &str, got: &[f32], written: usize) {
    assert_written(
        what,
        &got.iter().map(|f| (f.is_finite(), f.to_bits() == POISON_F32, f.to_bits())).collect::<Vec<_>>(),
        written,
    );
}

fn assert_written(what: &str, got: &[(bool, bool, u32)], written: usize) {
    assert!(written <= got.len(), "{what}: {written} written of {}", got.len());
    if let Some(i) = (0..written).find(|&i| !got[i].0) {
        let n = got[..written].iter().filter(|g| !g.0).count();
        let why = if got[i].1 { "still the poison: not written" } else { "non-finite result" };
        panic!("{what}: {n} of the {written} elements that must be written are not finite; first at {i}: bits {:#x} ({why})", got[i].2);
    }
    if let Some(i) = (written..got.len()).find(|&i| !got[i].1) {
        let n = got[written..].iter().filter(|g| !g.1).count();
        panic!(
            "{what}: {n} elements at or past {written} (must not be written) were written; first at {i}: bits {:#x}",
            got[i].2
        );
    }
}
