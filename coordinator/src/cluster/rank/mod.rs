//! Tensor-parallel groups that span nodes: a worker's rank 0 runs here, with its engine, and
//! each other rank on the node the worker's `rank_nodes` names, over one QUIC bi-stream per
//! rank with the cluster's mutual TLS (the frames are `zerolayer_common::wire::rank`).
//!
//! - [`lead`]: the leading node's side. It opens the streams, waits until every rank is built,
//!   and gives the engine a [`TensorParallel`](zerolayer_worker::backend::TensorParallel) whose
//!   remote ranks are [`lead::RemoteRank`]s and whose rank 0 sums through a [`StarLead`].
//! - [`host`]: the side of the node that hosts a rank: it checks the join against the cluster
//!   config, loads its shard and serves the stream until the leader goes.
//! - Here: [`Link`], a rank stream seen from threads (the model's kernel threads block; the
//!   stream is async), and the star collective over links: [`StarLead`] on rank 0,
//!   [`StarMember`] on the others. The sum is the rank-order sum every collective computes, so
//!   the group's bits equal the same group's on threads of one node.
//!
//! A group lives as long as its streams. A rank that goes (its node stops, the link is cut, a
//! frame no rank sends arrives) breaks the group: every wait on it ends in an error, not a hang,
//! within the QUIC idle timeout, and the leader closes the other ranks' connections.

pub mod host;
pub mod lead;
#[cfg(all(test, feature = "cuda-emulator"))]
mod on_the_emulator;

use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};

use zerolayer_common::wire::rank::{decode_rank, encode_rank, RankMsg, MAX_RANK_FRAME_BYTES};
use zerolayer_common::wire::frame_len_within;
use zerolayer_worker::collective::{sum_in_rank_order, Collective, CollectiveError};

/// Frames queued toward one side of a rank stream (a step has at most one in flight per
/// direction and channel; the bound only lets the reader run ahead a little).
const LINK_CAPACITY: usize = 4;

/// A rank stream seen from threads: frames out go through a bounded channel to a writer thread,
/// frames in are read by a reader thread and routed to `sums` (the collective's: `Partial`,
/// `Sum`) or `control` (everything else). Both threads block on the stream through the runtime
/// that created the link, and end when it does: the writer when every sender is dropped (it
/// then finishes the stream), the reader when the stream or connection ends.
pub struct Link {
    pub out: SyncSender<RankMsg>,
    pub sums: Receiver<RankMsg>,
    pub control: Receiver<RankMsg>,
}

impl Link {
    /// Starts the two threads on `send`/`recv` (call within a tokio runtime). `name` names them.
    pub fn start(name: &str, mut send: quinn::SendStream, mut recv: quinn::RecvStream) -> anyhow::Result<Link> {
        let rt = tokio::runtime::Handle::current();
        let (out, outbox) = sync_channel::<RankMsg>(LINK_CAPACITY);
        let (sums_tx, sums) = sync_channel(LINK_CAPACITY);
        let (control_tx, control) = sync_channel(LINK_CAPACITY);
        let wrt = rt.clone();
        std::thread::Builder::new().name(format!("zl-rank-out-{name}")).spawn(move || {
            while let Ok(m) = outbox.recv() {
                let frame = match encode_rank(&m) {
                    Ok(f) => f,
                    Err(e) => {
                        tracing::warn!(error = %e, "a rank frame could not be encoded; closing the stream");
                        break;
                    }
                };
                if wrt.block_on(send.write_all(&frame)).is_err() {
                    return;
                }
            }
            let _ = send.finish();
        })?;
        std::thread::Builder::new().name(format!("zl-rank-in-{name}")).spawn(move || loop {
            let m = match rt.block_on(read_rank_frame(&mut recv)) {
                Ok(Some(m)) => m,
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(error = %e, "a rank stream ended");
                    return;
                }
            };
            let to = if matches!(m, RankMsg::Partial(_) | RankMsg::Sum(_)) { &sums_tx } else { &control_tx };
            if to.send(m).is_err() {
                return;
            }
        })?;
        Ok(Link { out, sums, control })
    }
}

/// The next rank frame, or `None` if the stream finished cleanly before one.
pub async fn read_rank_frame(recv: &mut quinn::RecvStream) -> anyhow::Result<Option<RankMsg>> {
    let mut header = [0u8; 4];
    match recv.read_exact(&mut header).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(0)) => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = frame_len_within(header, MAX_RANK_FRAME_BYTES)?;
    let mut body = vec![0u8; n];
    recv.read_exact(&mut body).await?;
    Ok(Some(decode_rank(&body)?))
}

/// The connections of a group, closed together when it breaks or is dropped, so that every
/// thread waiting on one of its streams (here and on the hosts) stops waiting. It also holds
/// the endpoint that drives them, for as long as any rank of the group does.
#[derive(Clone, Default)]
pub struct Connections {
    conns: Arc<Mutex<Vec<quinn::Connection>>>,
    _endpoint: Option<quinn::Endpoint>,
}

impl Connections {
    /// The connections of a group that `endpoint` dials.
    pub fn on(endpoint: quinn::Endpoint) -> Self {
        Connections { conns: Arc::default(), _endpoint: Some(endpoint) }
    }
    pub fn add(&self, c: quinn::Connection) {
        self.conns.lock().unwrap_or_else(|e| e.into_inner()).push(c);
    }
    pub fn close(&self, why: &str) {
        for c in self.conns.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            c.close(1u32.into(), why.as_bytes());
        }
    }
}

/// Rank 0 of a star: takes every other rank's partial, sums in rank order, sends the sum back.
pub struct StarLead {
    size: usize,
    /// Per remote rank, in rank order: where its `Sum` goes, where its `Partial` comes from.
    ranks: Vec<(SyncSender<RankMsg>, Receiver<RankMsg>)>,
    conns: Connections,
    sum: Vec<f32>,
    broken: Option<String>,
}

impl StarLead {
    pub fn new(ranks: Vec<(SyncSender<RankMsg>, Receiver<RankMsg>)>, conns: Connections) -> Self {
        StarLead { size: ranks.len() + 1, ranks, conns, sum: Vec::new(), broken: None }
    }

    fn fail(&mut self, why: String) -> CollectiveError {
        tracing::warn!(error = %why, "a tensor-parallel group across nodes broke");
        self.conns.close(&why);
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
    use zerolayer_worker::collective::thread_group;

    /// A star whose streams are plain channels: rank 0's collective and the members'.
    fn star(size: usize) -> (StarLead, Vec<StarMember>) {
        let (mut lead_side, mut members) = (Vec::new(), Vec::new());
        for rank in 1..size {
            let (sums_tx, sums) = sync_channel(LINK_CAPACITY);
            let (out, partials) = sync_channel(LINK_CAPACITY);
            lead_side.push((sums_tx, partials));
            members.push(StarMember { rank, size, out, sums, broken: Arc::new(AtomicBool::new(false)) });
        }
        (StarLead::new(lead_side, Connections::default()), members)
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
