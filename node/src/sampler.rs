//! Token sampling: exact greedy at temperature 0; otherwise temperature, top-k, min-p and
//! top-p; before either, the request's logit bias and penalties ([`adjust`]).
//!
//! The random draw of step `k` is a pure function of `(seed, k)` (splitmix64), not a stream
//! advanced call by call. A sequence that continues elsewhere (replayed or migrated after
//! `k` tokens) starts its sampler at step `k` with the same seed, and so draws exactly what the
//! original would have: seeded sampling at temperature > 0 survives a move, as greedy does.

pub mod adjust;
pub mod logprob;

use zerolayer_common::SamplingParams;

use adjust::Adjust;

/// Per-sequence sampling state.
pub struct Sampler {
    temperature: f32,
    top_k: usize,
    top_p: f32,
    /// 0: off.
    min_p: f32,
    seed: u64,
    /// Tokens sampled so far (the next draw is step `step`).
    step: u64,
    candidates: Vec<(u32, f32)>,
    /// The logit bias and penalties, if the request has any, and a row to apply them to.
    adjust: Option<Adjust>,
    adjusted: Vec<f32>,
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The uniform draw in [0, 1) of step `step` of a sequence seeded with `seed`.
pub fn uniform(seed: u64, step: u64) -> f32 {
    (splitmix64(seed ^ splitmix64(step)) >> 40) as f32 / (1u64 << 24) as f32
}

impl Sampler {
    /// A sampler for a sequence that has already sampled `step` tokens (0 when it is new). With
    /// no seed in `p` one is drawn; [`Sampler::seed`] tells which, so the sequence can move.
    pub fn new(p: &SamplingParams, step: u64) -> Self {
        Sampler {
            temperature: p.temperature,
            top_k: p.top_k.filter(|&k| k > 0).map(|k| k as usize).unwrap_or(usize::MAX),
            top_p: p.top_p.unwrap_or(1.0).clamp(f32::MIN_POSITIVE, 1.0),
            min_p: p.min_p.unwrap_or(0.0).clamp(0.0, 1.0),
            seed: p.seed.unwrap_or_else(rand::random),
            step,
            candidates: Vec::new(),
            adjust: Adjust::new(p),
            adjusted: Vec::new(),
        }
    }

    /// Takes in the sequence's prompt and the tokens it generated before this sampler (a moved
    /// or replayed sequence's), which the penalties read.
    pub fn observe(&mut self, prompt: &[u32], generated: &[u32]) {
        if let Some(a) = &mut self.adjust {
            a.observe_prompt(prompt);
            generated.iter().for_each(|&t| a.record(t));
        }
    }

    /// Counts a drawn token in the history the penalties read.
    fn drew(&mut self, tok: u32) -> u32 {
        if let Some(a) = &mut self.adjust {
            a.record(tok);
        }
        tok
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Draws the next token from `logits`; with `allowed` (a grammar's bitset of the tokens it
    /// allows, bit `t % 32` of word `t / 32`), only from those.
    /// Whether every draw is the argmax of the row as the model computed it (so a device may
    /// pick the token itself): greedy, and nothing adjusts the logits.
    pub fn is_greedy(&self) -> bool {
        (self.temperature == 0.0 || self.top_k == 1) && self.adjust.is_none()
    }

    /// Records a draw a device made for a greedy sampler (the argmax of the logits, what
    /// [`Sampler::sample`] would return), keeping the step count as `sample` does.
    pub fn take_greedy(&mut self, token: u32) -> u32 {
        debug_assert!(self.is_greedy());
        self.step += 1;
        self.drew(token)
    }

    /// What a device may do of this sampler's next draw over a `vocab`-wide row with no
    /// grammar: pick the argmax (greedy), or select the top-k candidates (at most
    /// [`MAX_DEVICE_TOP_K`] of them, fewer than the vocabulary) for [`Sampler::sample_top_k`].
    pub fn pick(&self, vocab: usize) -> Pick {
        if self.is_greedy() {
            Pick::Greedy
        } else if self.adjust.is_some() {
            Pick::Host
        } else if self.top_k <= MAX_DEVICE_TOP_K && self.top_k < vocab {
            Pick::TopK { k: self.top_k as u32, inv_t: 1.0 / self.temperature }
        } else {
            Pick::Host
        }
    }

    pub fn sample(&mut self, logits: &[f32], allowed: Option<&[u32]>) -> u32 {
        let step = self.step;
        self.step += 1;
        let tok = match &self.adjust {
            None => self.sample_row(logits, allowed, step),
            Some(a) => {
                let mut row = std::mem::take(&mut self.adjusted);
                row.clear();
                row.extend_from_slice(logits);
                a.apply(&mut row);
                let tok = self.sample_row(&row, allowed, step);
                self.adjusted = row;
                tok
            }
        };
        self.drew(tok)
    }

    /// Step `step`'s draw from `logits` (already adjusted).
    fn sample_row(&mut self, logits: &[f32], allowed: Option<&[u32]>, step: u64) -> u32 {
        if self.temperature == 0.0 || self.top_k == 1 {
            return match allowed {
                None => argmax(logits),
                Some(mask) => argmax_allowed(logits, mask),
            };
        }
        let inv_t = 1.0 / self.temperature;
        let c = &mut self.candidates;
        c.clear();
        match allowed {
            None => c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l * inv_t))),
            Some(mask) => c.extend(set_bits(mask, logits.len()).map(|i| (i as u32, logits[i] * inv_t))),
        }
        if c.is_empty() {
            return argmax(logits);
        }
        if self.top_k < c.len() {
            c.select_nth_unstable_by(self.top_k - 1, by_desc);
            c.truncate(self.top_k);
        }
        self.draw(step)
    }

    /// The draw [`Sampler::sample`] makes, from the top-k `candidates` a device selected (what
    /// [`Pick::TopK`] asked for: token and logit × `inv_t`, in any order): the same candidates,
    /// so the same token, bit for bit.
    pub fn sample_top_k(&mut self, candidates: &[(u32, f32)]) -> u32 {
        debug_assert_eq!(candidates.len(), self.top_k);
        let step = self.step;
        self.step += 1;
        self.candidates.clear();
        self.candidates.extend_from_slice(candidates);
        let tok = self.draw(step);
        self.drew(tok)
    }

    /// Softmax, min-p, top-p and the seeded draw over `self.candidates` (temperature applied,
    /// top-k already taken).
    fn draw(&mut self, step: u64) -> u32 {
        let c = &mut self.candidates;
        c.sort_unstable_by(by_desc);
        let max = c[0].1;
        let mut sum = 0f32;
        for e in c.iter_mut() {
            e.1 = (e.1 - max).exp();
            sum += e.1;
        }
        // Min-p: the most likely candidate weighs exp(0) = 1, so a candidate's weight is its
        // probability relative to it.
        let mut keep = c.len();
        if self.min_p > 0.0 {
            keep = c.iter().take_while(|e| e.1 >= self.min_p).count().max(1);
            sum = c[..keep].iter().map(|e| e.1).sum();
        }
        // Nucleus: keep the smallest prefix whose mass reaches top_p.
        if self.top_p < 1.0 {
            let mut acc = 0f32;
            for (i, e) in c[..keep].iter().enumerate() {
                acc += e.1 / sum;
                if acc >= self.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f32 = c[..keep].iter().map(|e| e.1).sum();
        let mut r = uniform(self.seed, step) * mass;
        for e in &c[..keep] {
            r -= e.1;
            if r <= 0.0 {
                return e.0;
            }
        }
        c[keep - 1].0
    }
}

/// The candidates' order: larger (scaled) logit first by `total_cmp`, ties to the lower token.
/// A total order, so the top k of a row are one set whoever selects them.
fn by_desc(a: &(u32, f32), b: &(u32, f32)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// The `k` first of `logit × inv_t` over `logits` in [`by_desc`]'s order, in that order: what a
/// device returns for [`Pick::TopK`] (its kernels are checked against this).
pub fn select_top_k(logits: &[f32], k: usize, inv_t: f32) -> Vec<(u32, f32)> {
    let mut c: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l * inv_t)).collect();
    if k < c.len() {
        c.select_nth_unstable_by(k - 1, by_desc);
        c.truncate(k);
    }
    c.sort_unstable_by(by_desc);
    c
}

/// The most candidates a device selects for [`Pick::TopK`] (more are sampled on the host).
pub const MAX_DEVICE_TOP_K: usize = 256;

/// How much of a row's next draw a device may make.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Pick {
    /// The host samples the row's logits (a grammar, or more candidates than a device selects).
    Host,
    /// The argmax: a device may pick the token itself.
    Greedy,
    /// The `k` first of the row's `logit × inv_t` in [`by_desc`]'s order: a device may select
    /// them, and the host draws among them ([`Sampler::sample_top_k`]).
    TopK { k: u32, inv_t: f32 },
}

/// What a device did of a step's picks: for each logits row, the token of a `Greedy` row
/// (`tokens`, empty if the device picked none) and the candidates of a `TopK` row
/// (`candidates[ranges[row].0..][..ranges[row].1]`; `ranges` empty if it selected none).
#[derive(Default, Debug)]
pub struct Picked {
    pub tokens: Vec<u32>,
    pub candidates: Vec<(u32, f32)>,
    pub ranges: Vec<(usize, usize)>,
}

impl Picked {
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.candidates.clear();
        self.ranges.clear();
    }

    /// The token a device picked for `row`, if it did.
    pub fn token(&self, row: usize) -> Option<u32> {
        self.tokens.get(row).copied()
    }

    /// The candidates a device selected for `row`, if it did.
    pub fn candidates(&self, row: usize) -> Option<&[(u32, f32)]> {
        let &(at, n) = self.ranges.get(row)?;
        (n > 0).then(|| &self.candidates[at..at + n])
    }
}

/// The set bits of `mask` below `n`, in order.
fn set_bits(mask: &[u32], n: usize) -> impl Iterator<Item = usize> + '_ {
    mask.iter().enumerate().flat_map(move |(w, &bits)| {
        let mut b = bits;
        std::iter::from_fn(move || {
            if b == 0 {
                return None;
            }
            let i = b.trailing_zeros() as usize;
            b &= b - 1;
            Some(w * 32 + i)
        })
    })
    .take_while(move |&i| i < n)
}

/// [`argmax`] over the tokens `mask` allows (the first of them when none has a number).
pub fn argmax_allowed(logits: &[f32], mask: &[u32]) -> u32 {
    let mut best = None;
    let mut bv = f32::NEG_INFINITY;
    for i in set_bits(mask, logits.len()) {
        if best.is_none() || logits[i] > bv || bv.is_nan() {
            bv = logits[i];
            best = Some(i);
        }
    }
    best.unwrap_or(0) as u32
}

/// Index of the largest logit (the first, on ties). NaNs are never chosen over numbers.
/// (The kernels' vector form: the greedy draw is serial work in every step.)
pub fn argmax(logits: &[f32]) -> u32 {
    zerolayer_kernels::ops::argmax(logits) as u32
}

/// The gap between the largest and second-largest logit: how near a greedy choice is to a tie.
pub fn top_margin(logits: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in logits {
        if v > a {
            (a, b) = (v, a);
        } else if v > b {
            b = v;
        }
    }
    a - b
}

#[cfg(test)]
mod tests {

    #[test]
    fn top_margin_is_the_gap_to_the_runner_up() {
        assert_eq!(top_margin(&[1.0, 3.0, 2.5, -1.0]), 0.5);
        assert_eq!(top_margin(&[3.0, 1.0, 3.0]), 0.0);
        assert_eq!(top_margin(&[0.5, 2.0]), 1.5);
    }

    use super::*;

    #[test]
    fn greedy_is_exact_argmax() {
        let mut s = Sampler::new(&SamplingParams::greedy(1), 0);
        assert_eq!(s.sample(&[0.1, 3.0, 2.9999, -1.0], None), 1);
        assert_eq!(s.sample(&[5.0, 5.0], None), 0);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let p = SamplingParams { temperature: 1.0, top_k: Some(2), seed: Some(42), ..Default::default() };
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut a = Sampler::new(&p, 0);
        let mut b = Sampler::new(&p, 0);
        let xs: Vec<u32> = (0..64).map(|_| a.sample(&logits, None)).collect();
        let ys: Vec<u32> = (0..64).map(|_| b.sample(&logits, None)).collect();
        assert_eq!(xs, ys);
        // A sampler that starts at step 40 (a sequence that moved after 40 tokens) draws what
        // the original drew from step 40 on.
        let mut moved = Sampler::new(&p, 40);
        let zs: Vec<u32> = (40..64).map(|_| moved.sample(&logits, None)).collect();
        assert_eq!(zs, xs[40..]);
        // Without a seed one is drawn, and it can be read back to continue elsewhere.
        let mut unseeded = Sampler::new(&SamplingParams { seed: None, ..p.clone() }, 0);
        let first: Vec<u32> = (0..8).map(|_| unseeded.sample(&logits, None)).collect();
        let mut again = Sampler::new(&SamplingParams { seed: Some(unseeded.seed()), ..p.clone() }, 0);
        assert_eq!((0..8).map(|_| again.sample(&logits, None)).collect::<Vec<_>>(), first);
        let mut top: Vec<u32> = (0..50).collect();
        top.sort_by(|&i, &j| logits[j as usize].total_cmp(&logits[i as usize]));
        assert!(xs.iter().all(|x| top[..2].contains(x)));
        assert!(xs.contains(&top[0]) && xs.contains(&top[1]));
    }

    /// Drawing from the top-k candidates (as a device selects them, in any order) gives what
    /// sampling the whole row gives, step by step, ties included.
    #[test]
    fn sampling_from_selected_candidates_equals_sampling_the_row() {
        let mut logits: Vec<f32> = (0..500).map(|i| ((i * 7919 % 1000) as f32 * 0.013).sin() * 4.0).collect();
        logits[17] = logits[300]; // a tie across the cut
        logits[40] = -0.0;
        logits[41] = 0.0;
        for (t, k, p) in [(0.7f32, 40u32, None), (1.3, 5, Some(0.8)), (1.0, 256, Some(0.95)), (0.2, 2, None)] {
            let params = SamplingParams { temperature: t, top_k: Some(k), top_p: p, seed: Some(99), ..Default::default() };
            let (mut whole, mut picked) = (Sampler::new(&params, 3), Sampler::new(&params, 3));
            let Pick::TopK { k, inv_t } = picked.pick(logits.len()) else { panic!("top-k {k} is a device pick") };
            let mut c = select_top_k(&logits, k as usize, inv_t);
            assert_eq!(c.len(), k as usize);
            c.reverse(); // any order
            for _ in 0..20 {
                assert_eq!(whole.sample(&logits, None), picked.sample_top_k(&c));
            }
        }
        let many = Sampler::new(&SamplingParams { temperature: 1.0, top_k: Some(1000), ..Default::default() }, 0);
        assert_eq!(many.pick(50_000), Pick::Host);
        assert_eq!(Sampler::new(&SamplingParams { temperature: 1.0, ..Default::default() }, 0).pick(50_000), Pick::Host);
        assert_eq!(Sampler::new(&SamplingParams::greedy(1), 0).pick(50_000), Pick::Greedy);
    }

    /// The logit bias and the penalties against their formulas, written out here: a sampler
    /// with them, on the model's row, draws step by step what a plain sampler draws on the row
    /// adjusted by hand from the history so far; greedy and sampled, and after a move.
    #[test]
    fn penalties_and_bias_follow_their_formulas() {
        let base: Vec<f32> = (0..64).map(|i| ((i * 37 % 64) as f32 * 0.11).sin() * 3.0).collect();
        let prompt = [3u32, 5, 5, 9];
        let by_hand = |counts: &std::collections::HashMap<u32, u32>| -> Vec<f32> {
            let row = base.iter().enumerate().map(|(i, &raw)| {
                let (tok, mut l) = (i as u32, raw);
                if tok == 9 {
                    l += 2.0;
                }
                if tok == 40 {
                    l += -100.0;
                }
                let n = counts.get(&tok).copied().unwrap_or(0);
                if prompt.contains(&tok) || n > 0 {
                    l = if l > 0.0 { l / 1.3 } else { l * 1.3 };
                }
                if n > 0 {
                    l -= 0.3 * n as f32 + 0.5;
                }
                l
            });
            row.collect()
        };
        for (t, seed) in [(0.0f32, 1u64), (0.8, 7)] {
            let p = SamplingParams {
                temperature: t,
                seed: Some(seed),
                presence_penalty: 0.5,
                frequency_penalty: 0.3,
                repetition_penalty: Some(1.3),
                logit_bias: vec![(9, 2.0), (40, -100.0)],
                ..Default::default()
            };
            let plain_params = SamplingParams { temperature: t, seed: Some(seed), ..Default::default() };
            let (mut s, mut plain) = (Sampler::new(&p, 0), Sampler::new(&plain_params, 0));
            s.observe(&prompt, &[]);
            assert_eq!(s.pick(64), Pick::Host, "a device cannot pick from an adjusted row");
            let mut counts = std::collections::HashMap::new();
            let mut drawn = vec![];
            for step in 0..40 {
                let expect = plain.sample(&by_hand(&counts), None);
                let got = s.sample(&base, None);
                assert_eq!(got, expect, "temperature {t}, step {step}");
                *counts.entry(got).or_insert(0) += 1;
                drawn.push(got);
            }
            assert!(counts.len() > 3 && !counts.contains_key(&40), "the penalties move greedy decoding on: {drawn:?}");
            // A sequence that moves after 20 tokens rebuilds its history and draws the same.
            let mut moved = Sampler::new(&p, 20);
            moved.observe(&prompt, &drawn[..20]);
            assert_eq!((20..40).map(|_| moved.sample(&base, None)).collect::<Vec<_>>(), drawn[20..]);
        }
        let unpenalized = Sampler::new(&SamplingParams::greedy(1), 0);
        assert!(unpenalized.is_greedy());
    }

    #[test]
    fn min_p_keeps_the_tokens_near_the_most_likely() {
        let logits = [0.0f32, 0.6f32.ln(), 0.4f32.ln(), 0.1f32.ln()];
        let mut s = Sampler::new(&SamplingParams { temperature: 1.0, min_p: Some(0.5), seed: Some(3), ..Default::default() }, 0);
        let drawn: Vec<u32> = (0..300).map(|_| s.sample(&logits, None)).collect();
        assert!(drawn.contains(&0) && drawn.contains(&1));
        assert!(drawn.iter().all(|&t| t < 2), "weights 0.4 and 0.1 are under half the top's");
    }

    #[test]
    fn tiny_top_p_is_greedy() {
        let p = SamplingParams { temperature: 1.0, top_p: Some(1e-6), seed: Some(1), ..Default::default() };
        let mut s = Sampler::new(&p, 0);
        for _ in 0..20 {
            assert_eq!(s.sample(&[0.0, 1.0, 0.5], None), 1);
        }
    }

    #[test]
    fn a_mask_limits_greedy_and_sampled_draws_to_its_tokens() {
        let logits = [9.0, 1.0, 3.0, 2.0, 8.0];
        // Tokens 1, 2 and 3 allowed: 0 and 4 score higher but are never drawn.
        let mask = [0b01110u32];
        let mut g = Sampler::new(&SamplingParams::greedy(8), 0);
        assert_eq!(g.sample(&logits, Some(&mask)), 2);
        let mut t = Sampler::new(&SamplingParams { temperature: 1.0, seed: Some(3), ..SamplingParams::default() }, 0);
        for _ in 0..200 {
            assert!((1..=3).contains(&t.sample(&logits, Some(&mask))));
        }
        // Words past the logits (a vocabulary padded to the model's) are ignored.
        assert_eq!(argmax_allowed(&[0.0, 1.0], &[u32::MAX, u32::MAX]), 1);
    }
}
