//! Stall-free batching: how long an engine step takes, learnt online from the engine's own
//! steps, and the prefill budget that keeps a step carrying decodes short.
//!
//! A step computes every running decode (one token each) and, in the budget left, chunks of
//! prompts being prefilled. With a fixed token budget, a 512-token chunk makes the decodes in
//! the same step wait for it: every stream freezes for the chunk's time (on this CPU about half
//! a second per chunk on two threads). Sarathi-Serve's answer, used here: give prefill only what
//! keeps the step within a target time, and let prefill chunks fill it.
//!
//! - [`StepTimeModel`] predicts a step's time from its shape: `t ≈ a + b·tokens + c·attended`,
//!   where `attended` is the (query, key) pairs of its attention. It is fitted by recursive
//!   least squares with forgetting over the steps the engine actually ran, so it follows the
//!   machine, the thread count and the model, with nothing hard-coded.
//! - [`StallFree`] turns a prediction into a budget: a step that carries decodes may take
//!   `stretch` times what the decodes alone would take (at least `min_step`); prefill gets the
//!   tokens that fit in the difference, never fewer than `min_chunk`, so prompts keep moving under
//!   any decode load. With no decode running there is nothing to stall: the whole
//!   `max_batch_tokens` goes to prefill. Until the model has seen enough steps, the same.
//!
//! Pure: no clock and no I/O; the engine passes each step's shape and measured time in.

/// What a step computes, as its time depends on it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepShape {
    /// Tokens computed (rows through every matmul).
    pub tokens: usize,
    /// (query, key) pairs of attention: Σ over items of `len × (start + len)`.
    pub attended: f64,
}

impl StepShape {
    /// Adds one item: `len` tokens computed from position `start`.
    pub fn add(&mut self, start: usize, len: usize) {
        self.tokens += len;
        self.attended += len as f64 * (start + len) as f64;
    }
}

/// What the next step holds before any prefill is given to it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outlook {
    /// The decodes it will run.
    pub decodes: StepShape,
    /// The position the first prefill chunk would start at (the oldest prompt being prefilled).
    pub prefill_start: usize,
}

/// Feature scales, so the fit is well conditioned (tokens in the hundreds, pairs in the
/// hundreds of thousands).
const TOKENS_SCALE: f64 = 256.0;
const ATTENDED_SCALE: f64 = 256.0 * 1024.0;
/// Forgetting factor: the fit weighs about the last 200 steps.
const FORGET: f64 = 0.995;
/// Steps observed before predictions are used.
const WARM_STEPS: u64 = 4;
/// Caps the covariance so a long run of identical steps cannot wind it up.
const MAX_TRACE: f64 = 1e6;

/// One recursive-least-squares fit with forgetting over the first `N` features.
#[derive(Clone, Debug)]
struct Rls<const N: usize> {
    theta: [f64; N],
    p: [[f64; N]; N],
}

impl<const N: usize> Default for Rls<N> {
    fn default() -> Self {
        let mut p = [[0.0; N]; N];
        for (i, row) in p.iter_mut().enumerate() {
            row[i] = 1e3;
        }
        Rls { theta: [0.0; N], p }
    }
}

impl<const N: usize> Rls<N> {
    fn observe(&mut self, x: &[f64; 3], y: f64) {
        let px: [f64; N] = std::array::from_fn(|i| (0..N).map(|j| self.p[i][j] * x[j]).sum());
        let denom = FORGET + (0..N).map(|i| x[i] * px[i]).sum::<f64>();
        let k: [f64; N] = std::array::from_fn(|i| px[i] / denom);
        let err = y - (0..N).map(|i| x[i] * self.theta[i]).sum::<f64>();
        for (t, k) in self.theta.iter_mut().zip(&k) {
            *t += k * err;
        }
        let trace: f64 = (0..N).map(|i| self.p[i][i]).sum();
        let forget = if trace > MAX_TRACE { 1.0 } else { FORGET };
        let mut p = self.p;
        for (i, row) in p.iter_mut().enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v = (self.p[i][j] - k[i] * px[j]) / forget;
            }
        }
        self.p = p;
    }
}

/// The learnt step time, in seconds.
///
/// Two fits run side by side: the full one (`a + b·tokens + c·attended`) and a nested one
/// without the attention term (`a + b·tokens`). Attention is a small part of most steps, so
/// under timing noise (a busy machine, a neighbour's burst) the full fit's `c` can come out
/// negative, a model in which longer contexts make steps faster. Then the nested fit, which
/// noise cannot turn that way, is used instead of no model at all.
#[derive(Clone, Debug, Default)]
pub struct StepTimeModel {
    full: Rls<3>,
    nested: Rls<2>,
    steps: u64,
    /// The largest step seen (tokens): predictions beyond it are extrapolations.
    widest: usize,
}

impl StepTimeModel {
    fn features(s: &StepShape) -> [f64; 3] {
        [1.0, s.tokens as f64 / TOKENS_SCALE, s.attended / ATTENDED_SCALE]
    }

    /// Records that a step of `shape` took `seconds`.
    pub fn observe(&mut self, shape: StepShape, seconds: f64) {
        if shape.tokens == 0 || !seconds.is_finite() || seconds < 0.0 {
            return;
        }
        let x = Self::features(&shape);
        let y = seconds * 1e3; // fitted in milliseconds
        self.full.observe(&x, y);
        self.nested.observe(&x, y);
        self.steps += 1;
        self.widest = self.widest.max(shape.tokens);
    }

    /// The coefficients in use (scaled features): the full fit's if its attention term is not
    /// negative, else the nested fit's with no attention term.
    fn theta(&self) -> [f64; 3] {
        if self.uses_attention_term() {
            [self.full.theta[0], self.full.theta[1], self.full.theta[2].max(0.0)]
        } else {
            [self.nested.theta[0], self.nested.theta[1], 0.0]
        }
    }

    /// Whether the fit in use uses the attention term (false: the nested fit).
    pub fn uses_attention_term(&self) -> bool {
        self.full.theta[2] >= -1e-9
    }

    /// Whether enough steps were seen, and the fit in use makes sense (time grows with work).
    pub fn is_warm(&self) -> bool {
        self.steps >= WARM_STEPS && self.theta()[1] > 0.0
    }

    /// Predicted seconds for a step of `shape`.
    pub fn predict(&self, shape: &StepShape) -> f64 {
        let (x, theta) = (Self::features(shape), self.theta());
        let ms: f64 = (0..3).map(|i| x[i] * theta[i]).sum();
        ms.max(0.0) / 1e3
    }

    /// Steps observed.
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// (fixed ms, ms per token, ms per 1,000 attended pairs) of the fit in use: for logs and
    /// tests.
    pub fn coefficients(&self) -> (f64, f64, f64) {
        let theta = self.theta();
        (theta[0], theta[1] / TOKENS_SCALE, theta[2] / ATTENDED_SCALE * 1e3)
    }

    /// The most prefill tokens, starting at position `start`, that a step already holding
    /// `base` can take and stay within `seconds`.
    fn tokens_within(&self, base: &StepShape, start: usize, seconds: f64) -> usize {
        let left_ms = seconds * 1e3 - self.predict(base) * 1e3;
        if left_ms <= 0.0 {
            return 0;
        }
        // left ≥ b·p + a·p·(start + p): a quadratic in p.
        let theta = self.theta();
        let b = theta[1].max(0.0) / TOKENS_SCALE + theta[2] / ATTENDED_SCALE * start as f64;
        let a = theta[2] / ATTENDED_SCALE;
        let p = if a <= 0.0 {
            if b <= 0.0 {
                return usize::MAX;
            }
            left_ms / b
        } else {
            (-b + (b * b + 4.0 * a * left_ms).sqrt()) / (2.0 * a)
        };
        if p.is_finite() { p.max(0.0) as usize } else { 0 }
    }
}

/// The stall-free policy (from the worker's config).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StallFree {
    /// A step carrying decodes may take this many times what its decodes alone take. 0 turns
    /// stall-free batching off: prefill always gets the whole budget.
    pub stretch: f64,
    /// ...but may always take this long (seconds), so that cheap decode steps still leave
    /// prefill chunks large enough to be efficient.
    pub min_step: f64,
    /// Prefill tokens every step may take whatever the decode load, so prompts keep moving.
    pub min_chunk: usize,
    /// The step's whole token budget.
    pub max_batch_tokens: usize,
}

impl StallFree {
    /// Prefill tokens for the next step.
    pub fn prefill_budget(&self, model: &StepTimeModel, next: &Outlook) -> usize {
        let all = self.max_batch_tokens.saturating_sub(next.decodes.tokens);
        if self.stretch <= 0.0 || next.decodes.tokens == 0 || !model.is_warm() {
            return all;
        }
        let decode_only = model.predict(&next.decodes);
        let allowed = (self.stretch * decode_only).max(self.min_step);
        model.tokens_within(&next.decodes, next.prefill_start, allowed).clamp(self.min_chunk.min(all), all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine whose step costs 3 ms + 1 ms per token + 2 ms per 100k attended pairs.
    fn truth(s: &StepShape) -> f64 {
        (3.0 + s.tokens as f64 + 2.0 * s.attended / 1e5) / 1e3
    }

    fn shape(items: &[(usize, usize)]) -> StepShape {
        let mut s = StepShape::default();
        for &(start, len) in items {
            s.add(start, len);
        }
        s
    }

    fn trained() -> StepTimeModel {
        let mut m = StepTimeModel::default();
        // A mix of decode-only steps and steps with chunks, as an engine sees.
        for i in 0..300usize {
            let decodes = 1 + i % 16;
            let mut items: Vec<(usize, usize)> = (0..decodes).map(|d| (100 + 37 * d + i, 1)).collect();
            if i % 3 == 0 {
                items.push((((i * 97) % 1200), 32 + (i * 53) % 480));
            }
            let s = shape(&items);
            m.observe(s, truth(&s));
        }
        m
    }

    #[test]
    fn learns_a_linear_machine() {
        let m = trained();
        assert!(m.is_warm());
        let (fixed, per_token, per_k_pairs) = m.coefficients();
        assert!((fixed - 3.0).abs() < 0.05, "{fixed}");
        assert!((per_token - 1.0).abs() < 0.01, "{per_token}");
        assert!((per_k_pairs - 0.02).abs() < 0.001, "{per_k_pairs}");
        for items in [vec![(0, 512)], vec![(500, 1); 16], vec![(900, 64), (10, 1), (20, 1)]] {
            let s = shape(&items);
            let (p, t) = (m.predict(&s), truth(&s));
            assert!((p - t).abs() / t < 0.01, "{items:?}: predicted {p}, true {t}");
        }
    }

    #[test]
    fn follows_a_machine_that_slows_down() {
        let mut m = trained();
        let s = shape(&[(0, 256)]);
        let before = m.predict(&s);
        for i in 0..1000usize {
            let s = shape(&[(i % 300, 1 + (i * 31) % 300)]);
            m.observe(s, 2.0 * truth(&s));
        }
        let after = m.predict(&s);
        assert!((after / before - 2.0).abs() < 0.05, "before {before}, after {after}");
    }

    #[test]
    fn a_cold_model_or_no_decode_gives_prefill_everything() {
        let policy = StallFree { stretch: 2.5, min_step: 0.0, min_chunk: 16, max_batch_tokens: 512 };
        let cold = StepTimeModel::default();
        let next = Outlook { decodes: shape(&[(100, 1); 4]), prefill_start: 0 };
        assert_eq!(policy.prefill_budget(&cold, &next), 508);
        let m = trained();
        assert_eq!(policy.prefill_budget(&m, &Outlook { decodes: StepShape::default(), prefill_start: 0 }), 512);
        let off = StallFree { stretch: 0.0, ..policy };
        assert_eq!(off.prefill_budget(&m, &next), 508);
    }

    #[test]
    fn a_step_with_decodes_stays_within_its_stretch() {
        let m = trained();
        let policy = StallFree { stretch: 2.5, min_step: 0.0, min_chunk: 8, max_batch_tokens: 512 };
        for (decodes, start) in [(1usize, 0usize), (4, 0), (16, 0), (16, 1000), (8, 400)] {
            let d = shape(&vec![(300, 1); decodes]);
            let budget = policy.prefill_budget(&m, &Outlook { decodes: d, prefill_start: start });
            let mut with = d;
            with.add(start, budget);
            let (alone, step) = (truth(&d), truth(&with));
            assert!(budget >= 8 && budget < 512 - decodes, "{decodes} decodes: budget {budget}");
            assert!(step <= 2.5 * alone * 1.03 || budget == 8, "{decodes} decodes from {start}: {step} s against {alone} s alone");
            let mut one_more = with;
            one_more.add(start + budget, 1);
            assert!(truth(&one_more) > 2.5 * alone * 0.97, "{decodes} decodes: the budget {budget} leaves room unused");
        }
    }

    #[test]
    fn min_step_and_min_chunk_bound_the_budget_from_below() {
        let m = trained();
        let d = shape(&[(50, 1)]); // ~4 ms alone: 2.5x leaves ~6 tokens
        let tight = StallFree { stretch: 2.5, min_step: 0.0, min_chunk: 32, max_batch_tokens: 512 };
        assert_eq!(tight.prefill_budget(&m, &Outlook { decodes: d, prefill_start: 0 }), 32, "never below min_chunk");
        let roomy = StallFree { min_step: 0.050, min_chunk: 1, ..tight };
        let b = roomy.prefill_budget(&m, &Outlook { decodes: d, prefill_start: 0 });
        assert!((44..=47).contains(&b), "50 ms at 1 ms a token after a 4 ms step: {b}");
    }

    #[test]
    fn a_negative_attention_term_falls_back_to_the_nested_fit() {
        // Timings whose attention term comes out negative (as noise can make it when attention
        // is a small part of every step): without the nested fit the model never warms up and
        // stall-free batching stays off.
        let mut m = StepTimeModel::default();
        let noisy = |s: &StepShape| (3.0 + s.tokens as f64 - 0.5 * s.attended / 1e5) / 1e3;
        for i in 0..300usize {
            let s = shape(&[(((i * 97) % 1200), 32 + (i * 53) % 480), (100, 1)]);
            m.observe(s, noisy(&s).max(0.001));
        }
        assert!(!m.uses_attention_term());
        assert!(m.is_warm(), "{:?}", m.coefficients());
        let (fixed, per_token, per_k_pairs) = m.coefficients();
        assert_eq!(per_k_pairs, 0.0);
        assert!(fixed.is_finite() && per_token > 0.0, "{fixed} {per_token}");
        // Predictions grow with work, and a budget comes out.
        let (small, large) = (m.predict(&shape(&[(0, 64)])), m.predict(&shape(&[(0, 256)])));
        assert!(large > small, "{small} {large}");
        let policy = StallFree { stretch: 2.5, min_step: 0.0, min_chunk: 8, max_batch_tokens: 512 };
        let b = policy.prefill_budget(&m, &Outlook { decodes: shape(&[(300, 1); 4]), prefill_start: 0 });
        assert!((8..508).contains(&b), "{b}");
        // The trained model of a sane machine keeps its attention term.
        assert!(trained().uses_attention_term());
    }

    #[test]
    fn nonsense_is_ignored() {
        let mut m = trained();
        let before = m.coefficients();
        m.observe(StepShape::default(), 1.0);
        m.observe(shape(&[(0, 8)]), f64::NAN);
        m.observe(shape(&[(0, 8)]), -1.0);
        assert_eq!(before, m.coefficients());
    }
}
