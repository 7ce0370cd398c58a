//! Log-probabilities of a logits row, as the field reports them: the log-softmax of the raw row
//! the model computed (before any bias, penalty, temperature or truncation), which is what
//! llama.cpp (`llama_get_logits` through llama-cpp-python) and vLLM's default report.

use zerolayer_common::TokenLogprob;

/// `ln Σ exp(row)`, accumulated in f64 from the row's maximum.
pub fn log_sum_exp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row.iter().map(|&l| (l as f64 - max).exp()).sum();
    max + sum.ln()
}

/// Token `token`'s log-probability in `row`, and the `top` most likely tokens with theirs (most
/// likely first; a tie goes to the lower id).
pub fn token_logprob(row: &[f32], token: u32, top: usize) -> TokenLogprob {
    let lse = log_sum_exp(row);
    let lp = |t: u32| (row[t as usize] as f64 - lse) as f32;
    TokenLogprob { token, logprob: lp(token), top: top_ids(row, top).into_iter().map(|t| (t, lp(t))).collect() }
}

/// The ids of the `k` largest entries of `row`, largest first (ties: lower id first), in one
/// pass with a k-long sorted buffer (k is small: at most [`TokenLogprob::MAX_TOP`]).
fn top_ids(row: &[f32], k: usize) -> Vec<u32> {
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    if k == 0 {
        return Vec::new();
    }
    for (i, &l) in row.iter().enumerate() {
        if best.len() == k && !(l > best[k - 1].0) {
            continue;
        }
        let at = best.partition_point(|&(b, _)| b >= l);
        best.insert(at, (l, i as u32));
        best.truncate(k);
    }
    best.into_iter().map(|(_, t)| t).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference formula: log p_i = l_i − ln Σ_j exp(l_j), and the top list is the k largest.
    #[test]
    fn logprobs_are_the_log_softmax_of_the_row() {
        let row: Vec<f32> = (0..1000).map(|i| ((i * 7919 % 1000) as f32 / 97.0).sin() * 8.0).collect();
        let direct: f64 = row.iter().map(|&l| (l as f64).exp()).sum::<f64>().ln();
        let t = token_logprob(&row, 17, 5);
        assert!((t.logprob as f64 - (row[17] as f64 - direct)).abs() < 1e-5);
        let mut sorted: Vec<(u32, f32)> = row.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        sorted.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let want: Vec<u32> = sorted[..5].iter().map(|e| e.0).collect();
        assert_eq!(t.top.iter().map(|e| e.0).collect::<Vec<_>>(), want);
        let mass: f64 = row.iter().map(|&l| (l as f64 - direct).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-9);
        assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(token_logprob(&row, 3, 0).top.is_empty());
    }

    /// Ties keep the lower id first; a huge row stays finite.
    #[test]
    fn ties_and_extremes() {
        let row = [1.0f32, 3.0, 3.0, -1e30, 2.0];
        let t = token_logprob(&row, 3, 3);
        assert_eq!(t.top.iter().map(|e| e.0).collect::<Vec<_>>(), vec![1, 2, 4]);
        assert!(t.logprob.is_finite() || t.logprob == f32::NEG_INFINITY);
        let big = [1e4f32, 1e4 - 1.0];
        let t = token_logprob(&big, 0, 2);
        assert!((t.logprob as f64 - (-(1.0 + (-1f64).exp()).ln())).abs() < 1e-6);
    }
}
