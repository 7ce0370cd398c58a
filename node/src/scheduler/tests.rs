//! The scheduler's tests: admission, prefix reuse, preemption, bounds, the prefill budget.

use super::*;

fn cfg(num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig { block_size: 4, num_blocks, max_batch_tokens: budget, max_running: 8, max_waiting: 4, max_model_len: 1000 }
}

/// Runs the plan as if computed, sampling token 7 for every completing item.
impl Scheduler {
    /// Plans a step with `prefill` as the prefill budget and records it as computed (every
    /// completing item samples token 7).
    fn schedule_into_test(&mut self, prefill: usize) -> Plan {
        let mut p = Plan::default();
        self.schedule_into(&mut p, prefill);
        self.on_computed(&p);
        for it in &p.items {
            if it.completes {
                self.append_token(it.seq, 7);
            }
        }
        self.check_invariants();
        p
    }
}

fn step(s: &mut Scheduler) -> Plan {
    let p = s.schedule();
    s.on_computed(&p);
    for it in &p.items {
        if it.completes {
            s.append_token(it.seq, 7);
        }
    }
    s.check_invariants();
    p
}

#[test]
fn chunked_prefill_shares_the_budget_with_decodes() {
    let mut s = Scheduler::new(cfg(64, 8));
    s.add(1, vec![1, 2, 3], 10).unwrap();
    let p = step(&mut s);
    assert_eq!(p.items, vec![ScheduledItem { seq: 1, start: 0, len: 3, completes: true }]);
    s.add(2, (0..20).collect(), 10).unwrap();
    let p = step(&mut s);
    // The decode goes first, the long prompt gets the rest of the budget.
    assert_eq!(p.items[0], ScheduledItem { seq: 1, start: 3, len: 1, completes: true });
    assert_eq!(p.items[1], ScheduledItem { seq: 2, start: 0, len: 7, completes: false });
    let p = step(&mut s);
    assert_eq!(p.items[1], ScheduledItem { seq: 2, start: 7, len: 7, completes: false });
}

#[test]
fn prefix_blocks_are_reused() {
    let mut s = Scheduler::new(cfg(64, 64));
    let prompt: Vec<u32> = (0..13).collect();
    s.add(1, prompt.clone(), 2).unwrap();
    step(&mut s);
    s.remove(1);
    let mut p2 = prompt.clone();
    p2.extend([100, 101]);
    s.add(2, p2, 2).unwrap();
    let p = step(&mut s);
    // 3 full blocks (12 tokens) cached; 3 tokens computed.
    assert_eq!(p.items, vec![ScheduledItem { seq: 2, start: 12, len: 3, completes: true }]);
    assert_eq!(s.get(2).unwrap().cached_prompt_tokens, 12);
    // A fully cached prompt still computes its last token.
    s.remove(2);
    s.add(3, (0..12).collect(), 2).unwrap();
    let p = step(&mut s);
    assert_eq!(p.items, vec![ScheduledItem { seq: 3, start: 8, len: 4, completes: true }]);
}

#[test]
fn preempts_the_youngest_and_everything_finishes() {
    // 6 blocks of 4 tokens; each sequence needs up to 3 blocks (8 prompt + 4 out).
    let mut s = Scheduler::new(cfg(6, 64));
    for id in 0..4 {
        s.add(id, (0..8).map(|t| t + 100 * id as u32).collect(), 4).unwrap();
    }
    let mut done = vec![];
    let mut preempted = 0;
    for _ in 0..200 {
        let before = s.running_ids().to_vec();
        let p = step(&mut s);
        // Each victim is the youngest running sequence at that moment (the one admitted
        // last), never an older one.
        for (k, victim) in p.preempted.iter().enumerate() {
            assert_eq!(Some(victim), before.iter().rev().nth(k), "preempted {victim} while running (oldest first) {before:?}");
            preempted += 1;
        }
        for id in 0..4u64 {
            if let Some(q) = s.get(id) {
                if q.generated() >= q.max_tokens {
                    s.remove(id);
                    done.push(id);
                }
            }
        }
        if s.is_idle() {
            break;
        }
    }
    assert_eq!(done.len(), 4, "all finish");
    assert!(preempted > 0, "the pool was too small, so something was preempted");
    assert_eq!(s.stats.preemptions_total, preempted);
    assert_eq!(s.kv_blocks().free, 6);
    s.check_invariants();
}

#[test]
fn refuses_only_what_cannot_fit_alone_and_bounds_the_queue() {
    let mut s = Scheduler::new(cfg(4, 64));
    assert!(matches!(s.add(1, vec![1; 10], 7), Err(WorkerError::TooLong { .. })));
    s.add(1, vec![1; 10], 6).unwrap();
    for id in 2..5 {
        s.add(id, vec![1], 1).unwrap();
    }
    assert!(matches!(s.add(9, vec![1], 1), Err(WorkerError::QueueFull(4))));
}

#[test]
fn decodes_go_first_and_prefill_takes_only_its_budget() {
    let mut s = Scheduler::new(cfg(64, 64));
    // Two short prompts become decodes; then a long prompt arrives.
    s.add(1, vec![1; 4], 8).unwrap();
    s.add(2, vec![2; 4], 8).unwrap();
    step(&mut s);
    assert_eq!(s.outlook().decodes.tokens, 2, "both decode next");
    s.add(3, vec![3; 200], 4).unwrap();
    // The long prompt gets 10 tokens a step; both decodes run in every step, listed first.
    let mut prefilled = 0;
    for _ in 0..4 {
        let p = s.schedule_into_test(10);
        assert_eq!(p.items.iter().map(|it| it.seq).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert_eq!(p.items[2].len, 10);
        prefilled += p.items[2].len;
        assert_eq!(s.outlook().prefill_start, prefilled, "the outlook names where the prompt stands");
    }
    // A budget of 0 still moves the prompt by one token (prompts are never starved).
    let p = s.schedule_into_test(0);
    assert_eq!(p.items[2].len, 1);
    // The whole budget: the prompt takes what the step has left after the decodes.
    let p = s.schedule_into_test(usize::MAX);
    assert_eq!(p.items[2].len, 64 - 2);
}

#[test]
fn an_older_prompt_being_prefilled_does_not_hold_a_younger_decode_back() {
    let mut s = Scheduler::new(cfg(128, 32));
    s.add(2, vec![2; 3], 8).unwrap();
    s.add(1, vec![1; 200], 4).unwrap();
    let p = s.schedule_into_test(usize::MAX);
    assert_eq!(p.items.iter().map(|it| (it.seq, it.len)).collect::<Vec<_>>(), vec![(2, 3), (1, 29)]);
    // Make 1 the older, as after a preemption: it recomputes its prompt while 2 decodes.
    s.seqs.get_mut(&1).unwrap().arrival = 0;
    s.seqs.get_mut(&2).unwrap().arrival = 1;
    s.running = vec![1, 2];
    let p = s.schedule_into_test(8);
    assert_eq!(p.items.iter().map(|it| (it.seq, it.len)).collect::<Vec<_>>(), vec![(2, 1), (1, 8)], "the decode first; prefill within its budget");
    let p = s.schedule_into_test(usize::MAX);
    assert_eq!(p.items.iter().map(|it| (it.seq, it.len)).collect::<Vec<_>>(), vec![(2, 1), (1, 31)], "the step budget bounds prefill too");
}
