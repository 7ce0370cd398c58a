//! The worker actor on the real model, without HTTP: a failed step fails only its own
//! sequences and the worker keeps serving; a reader that does not keep up gets its deltas
//! merged (nothing lost, nothing blocks the engine); every command goes through the actor.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use zerolayer_common::{SamplingParams, SeqEvent, StopReason};
use zerolayer_tests::*;
use zerolayer_common::WorkerConfig;
use zerolayer_worker::{Job, SeqStream, WorkerError, WorkerHandle};

async fn worker(cfg: WorkerConfig) -> WorkerHandle {
    WorkerHandle::spawn(engine(cfg), "test").await.expect("worker starts")
}

fn prompt(handle_tok: &zerolayer_worker::tokenizer::Tokenizer, text: &str) -> Vec<u32> {
    handle_tok.encode(&format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")).unwrap()
}

/// Reads a stream to its end: (tokens, text, the final event, how many events arrived).
async fn drain(mut s: SeqStream) -> (Vec<u32>, String, SeqEvent, usize) {
    let (mut toks, mut text, mut n) = (vec![], String::new(), 0);
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(300), s.recv()).await.expect("events keep coming").expect("a final event");
        n += 1;
        match ev {
            SeqEvent::Delta { tokens, text: t, .. } => {
                toks.extend(tokens);
                text.push_str(&t);
            }
            SeqEvent::Started { .. } | SeqEvent::PromptLogprobs { .. } => {}
            fin @ SeqEvent::Finished { .. } => return (toks, text, fin, n),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_step_fails_only_its_sequences() {
    let _g = heavy();
    let tok = load_default().tokenizer;
    // One running sequence at a time: the second waits, outside the failing step.
    let w = worker(WorkerConfig { max_running: 1, block_size: 4, ..engine_cfg() }).await;
    let fail_next = Arc::new(AtomicBool::new(false));
    let f = fail_next.clone();
    w.set_step_hook(Some(Box::new(move |_ids| {
        if f.swap(false, Ordering::SeqCst) {
            return Err(WorkerError::Model("injected step failure".into()));
        }
        Ok(())
    })))
    .await
    .unwrap();
    let greedy = |n| SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) };
    let mut a = w.submit(Job::new(prompt(&tok, "Count to one hundred."), greedy(200))).await.unwrap();
    // A is decoding once it has produced a token.
    loop {
        if let SeqEvent::Delta { .. } = a.recv().await.unwrap() {
            break;
        }
    }
    let b = w.submit(Job::new(prompt(&tok, "Name a color."), greedy(8))).await.unwrap();
    fail_next.store(true, Ordering::SeqCst);
    let (_, _, fin_a, _) = drain(a).await;
    assert!(matches!(&fin_a, SeqEvent::Finished { reason: StopReason::Error(e), .. } if e.contains("injected")), "A was in the failed step: {fin_a:?}");
    let (toks_b, _, fin_b, _) = drain(b).await;
    assert!(matches!(fin_b, SeqEvent::Finished { reason: StopReason::MaxTokens, .. }), "B was waiting, outside the step, and completes: {fin_b:?}");
    assert_eq!(toks_b.len(), 8);
    // The worker keeps serving, and its KV blocks all came back.
    let c = w.submit(Job::new(prompt(&tok, "Say hi."), greedy(4))).await.unwrap();
    let (toks_c, ..) = drain(c).await;
    assert_eq!(toks_c.len(), 4);
    let mut sig = w.watch_signals();
    tokio::time::timeout(Duration::from_secs(10), sig.wait_for(|s| s.running == 0 && s.kv_blocks_free == s.kv_blocks_total)).await.unwrap().unwrap();
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_gets_merged_deltas_and_loses_nothing() {
    let _g = heavy();
    let tok = load_default().tokenizer;
    let w = worker(WorkerConfig { block_size: 4, ..engine_cfg() }).await;
    let p = prompt(&tok, "Tell me a long story about a lighthouse keeper.");
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(300) };
    // A reader that keeps up.
    let fast = w.submit(Job::new(p.clone(), params.clone())).await.unwrap();
    let (fast_toks, fast_text, ..) = drain(fast).await;
    // A reader that reads nothing until the sequence is over: 300 deltas do not fit the
    // 64-slot reply channel, and the engine must not wait for the reader.
    let slow = w.submit(Job::new(p, params)).await.unwrap();
    let mut sig = w.watch_signals();
    tokio::time::timeout(Duration::from_secs(300), sig.wait_for(|s| s.running == 0 && s.waiting == 0 && s.generated_tokens_total >= 600))
        .await
        .expect("the engine finished the sequence without its reader")
        .unwrap();
    let (slow_toks, slow_text, fin, slow_events) = drain(slow).await;
    assert_eq!(slow_toks, fast_toks, "every token arrives");
    assert_eq!(slow_text, fast_text);
    assert!(matches!(fin, SeqEvent::Finished { reason: StopReason::MaxTokens, usage } if usage.output_tokens == 300));
    assert!(slow_events <= zerolayer_worker::actor::REPLY_CAPACITY + 2, "the rest were merged ({slow_events} events)");
    w.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_hashes_and_shutdown_go_through_the_actor() {
    let _g = heavy();
    let tok = load_default().tokenizer;
    let w = worker(WorkerConfig { block_size: 4, ..engine_cfg() }).await;
    assert!(w.cached_hashes().await.unwrap().is_empty());
    let p = prompt(&tok, "What is the capital of France?");
    let s = w.submit(Job::new(p.clone(), SamplingParams::greedy(2))).await.unwrap();
    drain(s).await;
    let cached = w.cached_hashes().await.unwrap();
    let want = zerolayer_common::block_hashes(&p, 4);
    assert!(want.iter().all(|h| cached.contains(h)), "every full prompt block is cached");
    // Shutdown ends open sequences as `Lost` (their coordinator continues them elsewhere), and
    // later commands are refused.
    let open = w.submit(Job::new(p, SamplingParams { ignore_eos: true, ..SamplingParams::greedy(2000) })).await.unwrap();
    w.shutdown().await;
    let (.., fin, _) = drain(open).await;
    assert!(matches!(fin, SeqEvent::Finished { reason: StopReason::Lost(_), .. }), "{fin:?}");
    assert!(matches!(w.cached_hashes().await, Err(WorkerError::ShuttingDown)));
    let r = w.submit(Job::new(vec![1, 2, 3], SamplingParams::greedy(1))).await;
    assert!(matches!(r, Err(WorkerError::ShuttingDown)));
}
