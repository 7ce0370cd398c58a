//! Tensor-parallel groups that span nodes, the worker's half: everything but the transport.
//! A worker's rank 0 runs on its own node with the engine; each other rank runs on the node
//! the worker's `rank_nodes` names, and talks to rank 0 over one rank stream (the frames are
//! `zerolayer_common::wire::rank`). The coordinator's cluster link carries those streams over
//! QUIC with mutual TLS; tests carry them over in-process channels ([`channel_pair`]). Either
//! way the worker sees a stream as [`RankChannels`] and the link that carries the group's
//! streams as a [`RankLink`].
//!
//! - [`lead`]: the leading node's side: given every rank's channels, it waits until each rank is
//!   built and gives the engine a [`TensorParallel`](crate::backend::TensorParallel) whose
//!   remote ranks are [`lead::RemoteRank`]s and whose rank 0 sums through a [`StarLead`].
//! - [`host`]: the side of the node that hosts a rank: it checks the join against the cluster
//!   config, loads its shard, and serves the stream until the leader goes.
//! - Here: the star collective over rank streams, [`StarLead`] on rank 0 and [`StarMember`] on
//!   the others. The sum is the rank-order sum every collective computes, so the group's bits
//!   equal the same group's on threads of one node.
//!
//! A group lives as long as its streams. A rank that goes (its node stops, the link is cut, a
//! frame no rank sends arrives) breaks the group: every wait on it ends in an error, not a hang,
//! and the leader closes the other ranks' streams through the [`RankLink`].

pub mod host;
pub mod lead;

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::Arc;

use zerolayer_common::wire::rank::RankMsg;

use crate::collective::{sum_in_rank_order, Collective, CollectiveError};

/// Frames queued toward one side of a rank stream (a step has at most one in flight per
/// direction and channel; the bound only lets the reader run ahead a little).
pub const STREAM_CAPACITY: usize = 4;

/// A rank stream seen from threads: frames out go through a bounded channel, frames in arrive
/// routed to `sums` (the collective's: `Partial`, `Sum`) or `control` (everything else). What
/// carries them (QUIC, or a channel in tests) is the transport's business.
pub struct RankChannels {
    pub out: SyncSender<RankMsg>,
    pub sums: Receiver<RankMsg>,
    pub control: Receiver<RankMsg>,
}

/// What carries a group's rank streams, as the worker needs it: a way to end them all at once
/// (when the group breaks, or its leader goes), so that every thread waiting on one of them, on
/// this node and on the hosts, stops waiting.
pub trait RankLink: Send + Sync {
    fn close(&self, why: &str);
}

/// A link with nothing to close (a group whose streams end when their channels are dropped).
pub struct Unlinked;

impl RankLink for Unlinked {
    fn close(&self, _why: &str) {}
}

/// Two ends of one rank stream in memory: what one side sends, the other receives, routed as
/// [`RankChannels`] route it. The in-process transport (tests, and groups whose ranks share a
/// process); a side ends when its channels are dropped.
pub fn channel_pair() -> (RankChannels, RankChannels) {
    /// One direction: a sender, and the receiving side's two receivers behind a router thread.
    fn direction(name: &str) -> (SyncSender<RankMsg>, Receiver<RankMsg>, Receiver<RankMsg>) {
        let (out, outbox) = sync_channel::<RankMsg>(STREAM_CAPACITY);
        let (sums_tx, sums) = sync_channel(STREAM_CAPACITY);
        let (control_tx, control) = sync_channel(STREAM_CAPACITY);
        let _ = std::thread::Builder::new().name(format!("zl-rank-pipe-{name}")).spawn(move || {
            while let Ok(m) = outbox.recv() {
                let to = if matches!(m, RankMsg::Partial(_) | RankMsg::Sum(_)) { &sums_tx } else { &control_tx };
                if to.send(m).is_err() {
                    break;
                }
            }
        });
        (out, sums, control)
    }
    let (a_out, b_sums, b_control) = direction("ab");
    let (b_out, a_sums, a_control) = direction("ba");
    (RankChannels { out: a_out, sums: a_sums, control: a_control }, RankChannels { out: b_out, sums: b_sums, control: b_control })
}

/// Rank 0 of a star: takes every other rank's partial, sums in rank order, sends the sum back.
pub struct StarLead {
    size: usize,
    /// Per remote rank, in rank order: where its `Sum` goes, where its `Partial` comes from.
    ranks: Vec<(SyncSender<RankMsg>, Receiver<RankMsg>)>,
    link: Arc<dyn RankLink>,
    sum: Vec<f32>,
    broken: Option<String>,
}

impl StarLead {
    pub fn new(ranks: Vec<(SyncSender<RankMsg>, Receiver<RankMsg>)>, link: Arc<dyn RankLink>) -> Self {
        StarLead { size: ranks.len() + 1, ranks, link, sum: Vec::new(), broken: None }
    }

    fn fail(&mut self, why: String) -> CollectiveError {
        tracing::warn!(error = %why, "a tensor-parallel group across nodes broke");
        self.link.close(&why);
        self.broken = Some(why.clone());
        CollectiveError(why)
    }
}

impl Collective for StarLead {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if let Some(why) = &self.broken {
            return Err(CollectiveError(why.clone()));
        }
        let mut parts = Vec::with_capacity(self.ranks.len());
        for (i, (_, partials)) in self.ranks.iter().enumerate() {
            match partials.recv() {
                Ok(RankMsg::Partial(p)) if p.len() == buf.len() => parts.push(p),
                Ok(RankMsg::Partial(p)) => {
                    let why = format!("rank {} sent a partial of {} values for {}", i + 1, p.len(), buf.len());
                    return Err(self.fail(why));
                }
                Ok(_) => return Err(self.fail(format!("rank {} sent a sum to rank 0", i + 1))),
                Err(_) => return Err(self.fail(format!("rank {} is gone", i + 1))),
            }
        }
        self.sum.resize(buf.len(), 0.0);
        sum_in_rank_order(std::iter::once(&*buf).chain(parts.iter().map(Vec::as_slice)), &mut self.sum);
        for (i, (sums, _)) in self.ranks.iter().enumerate() {
            if sums.send(RankMsg::Sum(self.sum.clone())).is_err() {
                return Err(self.fail(format!("rank {} is gone", i + 1)));
            }
        }
        buf.copy_from_slice(&self.sum);
        Ok(())
    }
}

/// Rank 1.. of a star: sends its partial to rank 0 and takes the sum. Once it fails, `broken`
/// is set (the host then ends the stream).
pub struct StarMember {
    pub rank: usize,
    pub size: usize,
    pub out: SyncSender<RankMsg>,
    pub sums: Receiver<RankMsg>,
    pub broken: Arc<std::sync::atomic::AtomicBool>,
}

impl StarMember {
    fn exchange(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        if self.broken.load(std::sync::atomic::Ordering::Acquire) {
            return Err(CollectiveError("the group is broken".into()));
        }
        self.out.send(RankMsg::Partial(buf.to_vec())).map_err(|_| CollectiveError("rank 0 is gone".into()))?;
        match self.sums.recv() {
            Ok(RankMsg::Sum(s)) if s.len() == buf.len() => {
                buf.copy_from_slice(&s);
                Ok(())
            }
            Ok(_) => Err(CollectiveError("rank 0 sent a sum of another length, or a partial".into())),
            Err(_) => Err(CollectiveError("rank 0 is gone".into())),
        }
    }
}

impl Collective for StarMember {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let r = self.exchange(buf);
        if r.is_err() {
            self.broken.store(true, std::sync::atomic::Ordering::Release);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use crate::collective::thread_group;

    /// A star whose streams are plain channels: rank 0's collective and the members'.
    fn star(size: usize) -> (StarLead, Vec<StarMember>) {
        let (mut lead_side, mut members) = (Vec::new(), Vec::new());
        for rank in 1..size {
            let (sums_tx, sums) = sync_channel(STREAM_CAPACITY);
            let (out, partials) = sync_channel(STREAM_CAPACITY);
            lead_side.push((sums_tx, partials));
            members.push(StarMember { rank, size, out, sums, broken: Arc::new(AtomicBool::new(false)) });
        }
        (StarLead::new(lead_side, Arc::new(Unlinked)), members)
    }

    fn partial(rank: usize, len: usize, call: usize) -> Vec<f32> {
        // Magnitudes far apart, so that another order of the sum would round differently.
        let big = [0.0, 1e7, -3.3e6][rank % 3] * (call % 2) as f32;
        (0..len).map(|i| 0.1 * (i as f32 + 1.0) + rank as f32 * 1e-3 + big).collect()
    }

    const LENS: [usize; 4] = [1, 7, 1000, 3];

    /// One rank's calls: a buffer of each length in turn, reduced.
    fn calls(c: &mut dyn Collective) -> Vec<Vec<f32>> {
        let rank = c.rank();
        LENS.iter()
            .enumerate()
            .map(|(k, &len)| {
                let mut b = partial(rank, len, k);
                c.all_reduce_sum(&mut b).unwrap();
                b
            })
            .collect()
    }

    /// Every rank of a star gets the bits a group of threads computes, call after call.
    #[test]
    fn a_star_sums_what_a_thread_group_sums() {
        let size = 3;
        let by_threads: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = thread_group(size).into_iter().map(|mut c| sc.spawn(move || calls(&mut c))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (mut lead, members) = star(size);
        let by_star: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = members.into_iter().map(|mut c| sc.spawn(move || calls(&mut c))).collect();
            let mine = calls(&mut lead);
            std::iter::once(mine).chain(hs.into_iter().map(|h| h.join().unwrap())).collect()
        });
        assert_eq!(by_star, by_threads);
    }

    /// A partial of the wrong length, or a rank that is gone, breaks the star: an error on rank
    /// 0 (and on every later call), and the members see rank 0 go.
    #[test]
    fn a_bad_or_missing_rank_breaks_the_star() {
        let (mut lead, members) = star(2);
        members[0].out.send(RankMsg::Partial(vec![1.0; 3])).unwrap();
        let mut buf = vec![0.0; 4];
        let e = lead.all_reduce_sum(&mut buf).unwrap_err();
        assert!(e.0.contains("partial of 3 values for 4"), "{e}");
        assert!(lead.all_reduce_sum(&mut buf).is_err(), "broken for good");
        let (mut lead, members) = star(2);
        drop(members);
        assert!(lead.all_reduce_sum(&mut buf).unwrap_err().0.contains("gone"));
        let (lead, mut members) = star(2);
        drop(lead);
        assert!(members[0].all_reduce_sum(&mut buf).is_err());
        assert!(members[0].broken.load(std::sync::atomic::Ordering::Acquire));
    }
}
