//! `n` choices of one request (Chat Completions and Completions).
//!
//! Each choice is a sequence of its own: the same prompt and parameters under the choice's
//! seed ([`crate::frontend::service::choice_seed`]), so choices differ when sampled, repeat at
//! a seed, and each stays exact when it moves or is replayed. The prompt is computed once:
//! choice 0 starts alone, and once its first token arrives the others start on its worker and
//! read the whole prompt from the prefix cache. The usage counts the prompt once and every
//! choice's output. A stream interleaves the choices' chunks (each names its `index`) and ends
//! with one usage chunk and `[DONE]`.

use std::future::Future;

use axum::response::sse::Event;
use futures::stream::{BoxStream, SelectAll, StreamExt};
use serde_json::Value;
use zerolayer_common::Usage;

use super::chunks::Chunks;
use super::fields::bad;
use crate::error::ApiError;
use crate::frontend::api::shared::{collect_following, AppState, Collected, Following, SseStep};
use crate::frontend::service::Accepted;

/// Most choices in one request.
pub const MAX_CHOICES: u32 = 8;

/// `n`: how many choices (1 when absent or null), in 1..=[`MAX_CHOICES`].
pub fn parse_n(obj: &serde_json::Map<String, Value>) -> Result<u32, ApiError> {
    match obj.get("n") {
        None | Some(Value::Null) => Ok(1),
        Some(v) => match v.as_u64() {
            Some(n) if (1..=MAX_CHOICES as u64).contains(&n) => Ok(n as u32),
            _ => bad(format!("n: must be an integer from 1 to {MAX_CHOICES}")),
        },
    }
}

/// Follows the request's `n` choices: choice 0 (`first`) until its prompt is computed, then
/// the others, started beside it. A choice that cannot start fails the request (the started
/// ones are cancelled when dropped).
pub async fn follow(c: &AppState, first: Accepted, n: u32) -> Result<Vec<Following>, ApiError> {
    let mut first = Following::new(c.clone(), first);
    if n <= 1 {
        return Ok(vec![first]);
    }
    first.until_first_token().await;
    let others = futures::future::join_all((1..n).map(|i| c.fork(first.accepted(), i))).await;
    let mut all = vec![first];
    for acc in others {
        all.push(Following::new(c.clone(), acc?));
    }
    Ok(all)
}

/// Every choice whole, in order (non-streaming answers).
pub async fn collect(all: Vec<Following>) -> Result<Vec<Collected>, ApiError> {
    futures::future::join_all(all.into_iter().map(collect_following)).await.into_iter().collect()
}

/// A request's usage over its choices: the prompt once (as choice 0 computed it), the output
/// of all.
pub fn total_usage<'a>(usages: impl IntoIterator<Item = &'a Usage>) -> Usage {
    let mut it = usages.into_iter();
    let Some(first) = it.next() else { return Usage::default() };
    let mut total = first.clone();
    for u in it {
        total.output_tokens += u.output_tokens;
    }
    total
}

/// One choice's chunk producer, as [`Merged`] drives it.
pub trait ChoiceStream: Send + Sized + 'static {
    fn step(self) -> impl Future<Output = SseStep<Self>> + Send;
    /// Once its choice has finished (its last chunk sent): the usage and the timing for the
    /// end, taken once. A producer made for one of several choices ends this way instead of
    /// sending the usage chunk and `[DONE]` itself.
    fn take_end(&mut self) -> Option<(Usage, Value)>;
}

/// What one choice's producer yields to the merge.
enum Out {
    Events(Vec<Event>),
    /// Choice `.0` finished, with its usage and timing.
    End(usize, Usage, Value),
    /// The choice ended without a result (an error event was its last).
    Failed,
}

fn outs<S: ChoiceStream>(index: usize, s: S) -> BoxStream<'static, Out> {
    futures::stream::unfold(Some(s), move |s| async move {
        let (events, next) = s?.step().await;
        let mut out = vec![Out::Events(events)];
        let next = match next {
            Some(mut s) => match s.take_end() {
                Some((usage, timing)) => {
                    out.push(Out::End(index, usage, timing));
                    None
                }
                None => Some(s),
            },
            None => {
                out.push(Out::Failed);
                None
            }
        };
        Some((futures::stream::iter(out), next))
    })
    .flatten()
    .boxed()
}

/// The chunks of several choices, as they come.
pub struct Merged {
    all: SelectAll<BoxStream<'static, Out>>,
    head: Chunks,
    /// Each choice's usage, once it finished.
    usages: Vec<Option<Usage>>,
    finished: usize,
}

impl Merged {
    pub fn new<S: ChoiceStream>(choices: Vec<S>, head: Chunks) -> Self {
        let n = choices.len();
        Merged { all: futures::stream::select_all(choices.into_iter().enumerate().map(|(i, s)| outs(i, s))), head, usages: vec![None; n], finished: 0 }
    }

    pub async fn step(mut self) -> SseStep<Self> {
        loop {
            match self.all.next().await {
                Some(Out::Events(events)) if events.is_empty() => {}
                Some(Out::Events(events)) => return (events, Some(self)),
                Some(Out::End(index, usage, timing)) => {
                    self.usages[index] = Some(usage);
                    self.finished += 1;
                    if self.finished == self.usages.len() {
                        let mut out = Vec::new();
                        self.head.end(&total_usage(self.usages.iter().flatten()), timing, &mut out);
                        return (out, None);
                    }
                }
                // One choice failed: the stream ends with its error; the others are cancelled.
                Some(Out::Failed) | None => return (Vec::new(), None),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::frontend::service::choice_seed;

    #[test]
    fn each_choice_has_its_own_fixed_seed_and_choice_0_the_requests() {
        for seed in [0u64, 7, u64::MAX] {
            let seeds: Vec<u64> = (0..MAX_CHOICES).map(|i| choice_seed(seed, i)).collect();
            assert_eq!(seeds[0], seed, "one choice samples what it always did");
            let distinct: std::collections::HashSet<u64> = seeds.iter().copied().collect();
            assert_eq!(distinct.len(), seeds.len(), "{seeds:?}");
            assert_eq!(seeds, (0..MAX_CHOICES).map(|i| choice_seed(seed, i)).collect::<Vec<_>>(), "fixed");
        }
        assert_ne!(choice_seed(1, 1), choice_seed(2, 1));
    }

    #[test]
    fn n_is_from_1_to_8() {
        let n = |v: Value| parse_n(json!({"n": v}).as_object().unwrap());
        assert_eq!((n(json!(null)).unwrap(), n(json!(1)).unwrap(), n(json!(8)).unwrap()), (1, 1, 8));
        for bad in [json!(0), json!(9), json!(-1), json!(2.5), json!("2")] {
            assert!(n(bad.clone()).unwrap_err().to_string().contains("n:"), "{bad}");
        }
        let usage = |cached, output| Usage { prompt_tokens_uncached: 10 - cached, prompt_tokens_cached: cached, output_tokens: output };
        let total = total_usage(&[usage(0, 5), usage(8, 3), usage(8, 4)]);
        assert_eq!(total, usage(0, 12), "the prompt once, as choice 0 computed it; every choice's output");
    }
}
