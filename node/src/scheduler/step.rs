//! Planning one step (sans-IO, like the rest of the scheduler): which running sequences
//! compute how many tokens, what makes room for them (shrinking a prefill chunk, letting idle
//! pins go, preempting by [`fair::victim`]), and which waiting sequences are admitted.

use super::{extend_hashes, fair, Plan, ScheduledItem, Scheduler, SeqId, Sequence};
use crate::block_pool::BlockId;

/// What is left of a step's token budget: in all, and for prompt chunks.
struct Budget {
    tokens: usize,
    prefill: usize,
}

impl Scheduler {
    /// [`Scheduler::schedule`] into a reused plan (its vectors are cleared first), so the step
    /// loop does not allocate, giving prompts at most `prefill_budget` tokens (at least one).
    pub fn schedule_into(&mut self, plan: &mut Plan, prefill_budget: usize) {
        plan.items.clear();
        plan.started.clear();
        plan.preempted.clear();
        let mut budget = Budget { tokens: self.cfg.max_batch_tokens, prefill: prefill_budget.max(1) };
        self.schedule_running(plan, &mut budget);
        // 2. Admit waiting sequences: the next of the tenant with the smallest share ([`fair`]),
        //    while its prompt and reserved output fit the blocks no running sequence has
        //    reserved. A sequence that does not fit blocks those behind it, so a long prompt is
        //    not passed over for ever by short ones.
        while budget.tokens > 0 && budget.prefill > 0 && self.running.len() < self.cfg.max_running {
            if !self.admit_next(plan, &mut budget) {
                break;
            }
        }
    }

    /// 1. Running sequences: every decode first (one token each), then the next chunks of
    ///    prompts being prefilled, each group oldest first. So a prompt never holds a decode
    ///    back, and the prefill budget bounds how long the decodes' step takes.
    fn schedule_running(&mut self, plan: &mut Plan, budget: &mut Budget) {
        let mut order = std::mem::take(&mut self.order);
        order.clear();
        let need = |s: &Sequence| s.tokens.len() - s.num_computed;
        order.extend(self.running.iter().copied().filter(|r| need(&self.seqs[r]) == 1));
        order.extend(self.running.iter().copied().filter(|r| need(&self.seqs[r]) > 1));
        for &id in &order {
            if budget.tokens == 0 {
                break;
            }
            if !self.running.contains(&id) {
                continue; // preempted earlier in this step
            }
            let (need, computed, cap) = {
                let s = &self.seqs[&id];
                let need = s.tokens.len() - s.num_computed;
                (need, s.num_computed, s.chunk_cap(need))
            };
            debug_assert!(need > 0, "running sequence {id} has nothing to compute");
            let n = if need == 1 { 1 } else { need.min(budget.tokens).min(budget.prefill).min(cap) };
            if n == 0 {
                continue;
            }
            let Some(n) = self.make_room(id, n, plan) else {
                continue; // waits a step, or preempted itself
            };
            let want_blocks = self.blocks_for(computed + n);
            let s = self.seqs.get_mut(&id).unwrap();
            while s.blocks.len() < want_blocks {
                let b = self.pool.allocate_after(s.blocks.last().copied()).expect("capacity checked");
                s.blocks.push(b);
            }
            plan.items.push(ScheduledItem { seq: id, start: computed, len: n, completes: computed + n == s.tokens.len() });
            budget.tokens -= n;
            if need > 1 {
                budget.prefill -= n;
            }
        }
        self.order = order;
    }

    /// Room for running sequence `id` to compute `n` more tokens: the chunk that fits (a
    /// prefill chunk shrinks to what fits), after idle pins are let go and, failing that,
    /// others are preempted ([`fair::victim`]). `None` if it waits a step (the only sequences
    /// to take from are a smaller tenant's) or preempted itself.
    fn make_room(&mut self, id: SeqId, n: usize, plan: &mut Plan) -> Option<usize> {
        let bs = self.cfg.block_size;
        let (need, computed, have_blocks) = {
            let s = &self.seqs[&id];
            (s.tokens.len() - s.num_computed, s.num_computed, s.blocks.len())
        };
        loop {
            let capacity = (have_blocks + self.pool.num_free()) * bs - computed;
            if capacity >= n {
                return Some(n);
            }
            // Pins hold against cached traffic, not against work: before anything running
            // is preempted, idle pinned prefixes become evictable.
            if self.pool.unpin_idle() > 0 {
                continue;
            }
            if capacity > 0 && need > 1 {
                return Some(capacity);
            }
            let victim = {
                let running: Vec<fair::Seat> = self.running.iter().map(|r| self.seqs[r].seat()).collect();
                let usage = fair::Usage::of(&running);
                fair::victim(&running, &self.seqs[&id].seat(), &usage, self.cfg.max_running, self.cfg.num_blocks)
            }?;
            self.preempt(victim, plan);
            if victim == id {
                return None;
            }
        }
    }

    /// Admits the next waiting sequence if it fits (see [`Scheduler::schedule_into`]); false
    /// when none can be admitted this step.
    fn admit_next(&mut self, plan: &mut Plan, budget: &mut Budget) -> bool {
        let bs = self.cfg.block_size;
        let (pos, outstanding) = {
            let running: Vec<fair::Seat> = self.running.iter().map(|r| self.seqs[r].seat()).collect();
            let usage = fair::Usage::of(&running);
            let waiting: Vec<fair::Seat> = self.waiting.iter().map(|w| self.seqs[w].seat()).collect();
            let Some(pos) = fair::next_waiting(&waiting, &usage, self.cfg.max_running, self.cfg.num_blocks) else { return false };
            let candidate = waiting[pos];
            let outstanding: usize = self
                .running
                .iter()
                .map(|r| &self.seqs[r])
                .filter(|s| fair::reservation_holds(&s.seat(), &candidate, &usage, self.cfg.max_running, self.cfg.num_blocks))
                .map(|s| self.blocks_for(s.reserved_until).saturating_sub(s.blocks.len()))
                .sum();
            (pos, outstanding)
        };
        let id = self.waiting[pos];
        if plan.preempted.contains(&id) {
            return false; // don't re-admit in the step that preempted it
        }
        let nothing_running = self.running.is_empty();
        let s = self.seqs.get_mut(&id).unwrap();
        extend_hashes(s, bs);
        // Reuse cached full blocks, but always compute at least the last token (and every
        // token, for a sequence that wants each position's logits).
        let max_match = if s.prompt_logits { 0 } else { (s.tokens.len() - 1) / bs };
        let mut matched: Vec<BlockId> = Vec::new();
        for j in 0..max_match.min(s.hashes.len()) {
            match self.pool.lookup(s.name(j, bs)) {
                Some(b) => matched.push(b),
                None => break,
            }
        }
        let matched_tokens = matched.len() * bs;
        let remaining = s.tokens.len() - matched_tokens;
        // Matched blocks that count as free now (evictable) stop counting once acquired; idle
        // pinned ones never counted (counting them too left a prompt whose prefix is pinned
        // waiting forever on an idle worker once the pins held as many blocks as were free).
        let idle_matched = matched.iter().filter(|&&b| self.pool.is_evictable(b)).count();
        let free = self.pool.num_free();
        if free < idle_matched {
            return false;
        }
        let free_after_match = free - idle_matched;
        // Room for the rest of the prompt and the reserved output, beside every running
        // sequence's reservation (unless nothing runs: then it fits alone, as `add` checked).
        let left = s.max_tokens.saturating_sub(s.tokens.len() - s.prompt_len);
        let reserve = if s.preemptions > 0 { left } else { left.min(self.cfg.reserve_output_tokens) };
        let reserved_until = s.tokens.len() + reserve;
        let needed = reserved_until.div_ceil(bs).saturating_sub(matched.len());
        if !nothing_running && needed + outstanding > free_after_match {
            return false;
        }
        // Largest chunk that fits the budget and the free blocks.
        let partial_slots = 0; // matched blocks are full
        let cap_tokens = free_after_match * bs + partial_slots;
        let n = remaining.min(budget.tokens).min(budget.prefill).min(cap_tokens).min(s.chunk_cap(remaining));
        if n == 0 {
            return false;
        }
        for &b in &matched {
            self.pool.acquire(b);
        }
        s.blocks = matched;
        s.reserved_until = reserved_until;
        s.num_registered = s.blocks.len();
        s.num_computed = matched_tokens;
        let want_blocks = (matched_tokens + n).div_ceil(bs);
        while s.blocks.len() < want_blocks {
            let b = self.pool.allocate_after(s.blocks.last().copied()).expect("capacity checked");
            s.blocks.push(b);
        }
        if !s.started {
            s.started = true;
            s.cached_prompt_tokens = matched_tokens.min(s.prompt_len);
            self.stats.prefix_cache_queries_total += s.prompt_len as u64;
            self.stats.prefix_cache_hits_total += s.cached_prompt_tokens as u64;
            plan.started.push(id);
        }
        plan.items.push(ScheduledItem { seq: id, start: matched_tokens, len: n, completes: matched_tokens + n == s.tokens.len() });
        budget.tokens -= n;
        budget.prefill -= n;
        self.waiting.remove(pos);
        // Keep `running` in arrival order.
        let arrival = s.arrival;
        let pos = self.running.partition_point(|r| self.seqs[r].arrival < arrival);
        self.running.insert(pos, id);
        true
    }
}
