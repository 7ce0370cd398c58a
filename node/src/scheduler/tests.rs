//! The scheduler's tests: admission, prefix reuse, preemption, bounds, the prefill budget.

use super::*;

fn cfg(num_blocks: usize, budget: usize) -> SchedulerConfig {
    SchedulerConfig { block_size: 4, num_blocks, max_batch_tokens: budget, max_running: 8, max_waiting: 4, max_model_len: 1000, reserve_output_tokens: 0 }
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
    s.add(1, Entry::new(vec![1, 2, 3], 10)).unwrap();
    let p = step(&mut s);
    assert_eq!(p.items, vec![ScheduledItem { seq: 1, start: 0, len: 3, completes: true }]);
    s.add(2, Entry::new((0..20).collect(), 10)).unwrap();
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
    s.add(1, Entry::new(prompt.clone(), 2)).unwrap();
    step(&mut s);
    s.remove(1);
    let mut p2 = prompt.clone();
    p2.extend([100, 101]);
    s.add(2, Entry::new(p2, 2)).unwrap();
    let p = step(&mut s);
    // 3 full blocks (12 tokens) cached; 3 tokens computed.
    assert_eq!(p.items, vec![ScheduledItem { seq: 2, start: 12, len: 3, completes: true }]);
    assert_eq!(s.get(2).unwrap().cached_prompt_tokens, 12);
    // A fully cached prompt still computes its last token.
    s.remove(2);
    s.add(3, Entry::new((0..12).collect(), 2)).unwrap();
    let p = step(&mut s);
    assert_eq!(p.items, vec![ScheduledItem { seq: 3, start: 8, len: 4, completes: true }]);
}

#[test]
fn preempts_the_youngest_and_everything_finishes() {
    // 6 blocks of 4 tokens; each sequence needs up to 3 blocks (8 prompt + 4 out).
    let mut s = Scheduler::new(cfg(6, 64));
    for id in 0..4 {
        s.add(id, Entry::new((0..8).map(|t| t + 100 * id as u32).collect(), 4)).unwrap();
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
    assert!(matches!(s.add(1, Entry::new(vec![1; 10], 7)), Err(WorkerError::TooLong { .. })));
    s.add(1, Entry::new(vec![1; 10], 6)).unwrap();
    for id in 2..5 {
        s.add(id, Entry::new(vec![1], 1)).unwrap();
    }
    assert!(matches!(s.add(9, Entry::new(vec![1], 1)), Err(WorkerError::QueueFull(4))));
}

#[test]
fn decodes_go_first_and_prefill_takes_only_its_budget() {
    let mut s = Scheduler::new(cfg(64, 64));
    // Two short prompts become decodes; then a long prompt arrives.
    s.add(1, Entry::new(vec![1; 4], 8)).unwrap();
    s.add(2, Entry::new(vec![2; 4], 8)).unwrap();
    step(&mut s);
    assert_eq!(s.outlook().decodes.tokens, 2, "both decode next");
    s.add(3, Entry::new(vec![3; 200], 4)).unwrap();
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
    s.add(2, Entry::new(vec![2; 3], 8)).unwrap();
    s.add(1, Entry::new(vec![1; 200], 4)).unwrap();
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

/// One key (A) runs four sequences that together need far more KV than there is; another key
/// (B) sends short requests meanwhile. B's requests are admitted within a few steps of arriving
/// and never preempted (A gives way), A's sequences all finish, and a sequence preempted once is
/// let back in only with room for all of it, so none is preempted twice.
#[test]
fn one_key_cannot_crowd_out_another() {
    let a = Share::of("a", 1.0);
    let b = Share::of("b", 1.0);
    let mut s = Scheduler::new(SchedulerConfig { max_waiting: 64, reserve_output_tokens: 8, ..cfg(40, 64) });
    for id in 0..4u64 {
        s.add(id, Entry::new(vec![id as u32; 8], 100).resumed(8).shared(a)).unwrap();
    }
    let (mut next_b, mut b_arrived, mut b_waits, mut done) = (100u64, std::collections::HashMap::new(), vec![], vec![]);
    for t in 0..3000 {
        // A short B request every 25 steps, after A has filled the cache.
        if t >= 60 && t % 25 == 0 && next_b < 120 {
            s.add(next_b, Entry::new(vec![9; 4], 4).resumed(4).shared(b)).unwrap();
            b_arrived.insert(next_b, t);
            next_b += 1;
        }
        let p = step(&mut s);
        for id in &p.started {
            if let Some(at) = b_arrived.get(id) {
                b_waits.push(t - at);
            }
        }
        for id in p.preempted.iter() {
            assert!(*id < 100, "B's sequence {id} was preempted");
        }
        let ids = s.sequence_ids();
        for id in ids {
            let q = s.get(id).unwrap();
            if q.generated() >= q.max_tokens {
                s.remove(id);
                done.push(id);
            }
        }
        if s.is_idle() && next_b == 120 {
            break;
        }
    }
    assert_eq!(done.len(), 24, "all of A's and B's requests finish");
    assert_eq!(b_waits.len(), 20);
    let worst = *b_waits.iter().max().unwrap();
    assert!(worst <= 4, "B waited up to {worst} steps for admission: {b_waits:?}");
    assert!(s.stats.preemptions_total > 0, "the cache was too small for A: something was preempted");
    assert_eq!(s.stats.repreemptions_total, 0, "no sequence was preempted twice");
}

#[test]
fn admission_reserves_room_for_output() {
    // 10 blocks of 4: a 16-token prompt with 16 reserved output tokens takes 8; a second such
    // sequence must wait, though its prompt alone would fit.
    let mut s = Scheduler::new(SchedulerConfig { reserve_output_tokens: 16, ..cfg(10, 64) });
    s.add(1, Entry::new(vec![1; 16], 20)).unwrap();
    s.add(2, Entry::new(vec![2; 8], 20)).unwrap();
    let p = step(&mut s);
    assert_eq!(p.started, vec![1]);
    assert_eq!(s.num_waiting(), 1, "no room for 2's prompt and reserved output beside 1's reservation");
}

/// A prompt whose prefix is pinned and idle is admitted on an idle worker even when the pins
/// hold as many blocks as are free: the pinned blocks it reuses were never counted as free.
/// (They were subtracted from the free blocks anyway, and the prompt waited forever.)
#[test]
fn a_prompt_reusing_idle_pinned_blocks_is_admitted() {
    let mut s = Scheduler::new(cfg(6, 64));
    s.set_max_pinned(3);
    let prompt: Vec<u32> = (0..13).collect(); // 3 full blocks of 4, and one token
    s.add(1, Entry::new(prompt.clone(), 1)).unwrap();
    step(&mut s);
    assert_eq!(s.pin_prefix(1, 12, 1_000), Some(3));
    s.remove(1);
    assert_eq!(s.kv_blocks().free, 3, "6 blocks, 3 pinned and idle");
    let mut longer = prompt[..12].to_vec();
    longer.extend(100..105); // 17 tokens: the 3 pinned blocks and 2 more
    s.add(2, Entry::new(longer, 1)).unwrap();
    let p = step(&mut s);
    assert_eq!(p.items, vec![ScheduledItem { seq: 2, start: 12, len: 5, completes: true }], "admitted over its pinned prefix");
    assert_eq!(s.get(2).unwrap().cached_prompt_tokens, 12);
}

/// A computed prompt prefix pinned for a TTL stays pinned until its pin expires; a later
/// request's pin on the same prefix refreshes it.
#[test]
fn pins_hold_until_they_expire_and_a_later_pin_refreshes_them() {
    let mut s = Scheduler::new(cfg(8, 64));
    s.set_max_pinned(4);
    let prompt: Vec<u32> = (0..13).collect(); // 3 full blocks of 4
    s.add(1, Entry::new(prompt.clone(), 2)).unwrap();
    assert_eq!(s.pin_prefix(1, 12, 100), None, "not computed yet");
    step(&mut s);
    assert_eq!(s.pin_prefix(1, 12, 100), Some(3));
    s.remove(1);
    s.expire_pins(99);
    assert_eq!(s.num_pinned(), 3, "live until 100");
    s.add(2, Entry::new(prompt, 2)).unwrap();
    step(&mut s);
    assert_eq!(s.pin_prefix(2, 12, 200), Some(3), "a hit pins the same blocks again");
    s.remove(2);
    s.expire_pins(150);
    assert_eq!(s.num_pinned(), 3, "refreshed: still pinned at 150");
    s.expire_pins(200);
    assert_eq!(s.num_pinned(), 0, "expired at 200");
    s.check_invariants();
}
