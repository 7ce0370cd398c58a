//! chitchat's gossip carried over the node's QUIC endpoint, so membership inherits mutual TLS:
//! a peer without a cluster certificate cannot even deliver a gossip message.
//!
//! Each gossip message travels as one unidirectional stream on a cached connection to the
//! peer's address (see [`Relays`] for how the bytes reach chitchat). Sends never block the
//! gossip loop: they run on spawned tasks, at most [`MAX_SENDS_IN_FLIGHT`] at once, each bounded
//! by [`SEND_TIMEOUT`]; a message that does not fit is dropped (gossip repairs loss on the next
//! round), and so is one that meets a full socket buffer on the way in.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chitchat::transport::{RecvOutcome, SendOutcome, Socket, Transport};
use chitchat::ChitchatEnvelope;
use tokio::sync::Semaphore;

use super::tls::SERVER_NAME;

/// Gossip messages being sent at once; more are dropped.
pub const MAX_SENDS_IN_FLIGHT: usize = 64;
/// A send (including connecting) that takes longer is abandoned.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest gossip message accepted (chitchat's own UDP limit).
pub const MAX_GOSSIP_BYTES: usize = 65_507;

/// Whether the peer of `conn` holds a certificate that names `node`.
pub fn reaches(conn: &quinn::Connection, node: &str) -> bool {
    let cert = conn.peer_identity().and_then(|i| i.downcast::<Vec<rustls::pki_types::CertificateDer<'static>>>().ok()).and_then(|v| v.first().cloned());
    cert.is_some_and(|c| super::identity::cert_names(&c, node))
}

/// Outgoing connections by peer address, shared by gossip and request forwarding.
pub struct Peers {
    endpoint: quinn::Endpoint,
    conns: Mutex<HashMap<SocketAddr, quinn::Connection>>,
    connect_timeout: Duration,
}

impl Peers {
    pub fn new(endpoint: quinn::Endpoint, connect_timeout: Duration) -> Self {
        Peers { endpoint, conns: Mutex::new(HashMap::new()), connect_timeout }
    }

    /// A live connection to `addr`, reusing a cached one.
    pub async fn connect(&self, addr: SocketAddr) -> anyhow::Result<quinn::Connection> {
        if let Some(c) = self.conns.lock().unwrap().get(&addr) {
            if c.close_reason().is_none() {
                return Ok(c.clone());
            }
        }
        let connecting = self.endpoint.connect(addr, SERVER_NAME)?;
        let conn = tokio::time::timeout(self.connect_timeout, connecting)
            .await
            .map_err(|_| anyhow::anyhow!("connecting to {addr}: timed out"))??;
        self.conns.lock().unwrap().insert(addr, conn.clone());
        Ok(conn)
    }

    /// A live connection to `addr` that reaches `node`: its certificate must name `node`, not
    /// only the cluster's shared name. Every dial that means a particular node (forwarding a
    /// request, sending KV, joining a rank) goes through here, so an address that gossip or a
    /// stale config points at another node's certificate holder reaches nobody.
    pub async fn connect_node(&self, addr: SocketAddr, node: &str) -> anyhow::Result<quinn::Connection> {
        let conn = self.connect(addr).await?;
        anyhow::ensure!(reaches(&conn, node), "the node at {addr} is not {node}: its certificate names another node");
        Ok(conn)
    }

    /// Forgets the connection to `addr` (after a failure).
    pub fn forget(&self, addr: SocketAddr) {
        self.conns.lock().unwrap().remove(&addr);
    }

    /// Forgets connections to addresses not in `keep` (peers that died or moved).
    pub fn retain(&self, keep: &std::collections::HashSet<SocketAddr>) {
        self.conns.lock().unwrap().retain(|a, c| {
            let k = keep.contains(a);
            if !k {
                c.close(0u32.into(), b"peer gone");
            }
            k
        });
    }

    pub fn len(&self) -> usize {
        self.conns.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn close_all(&self) {
        for (_, c) in self.conns.lock().unwrap().drain() {
            c.close(0u32.into(), b"node stopping");
        }
    }
}

/// Loopback relays, one per peer, between chitchat's own UDP socket and QUIC.
///
/// chitchat 0.13 keeps its message encoding crate-private, so this transport lets chitchat's
/// `UdpSocket` encode and decode, bound to an ephemeral loopback port, and moves the bytes:
/// - out: chitchat sends to the peer's relay address; the relay forwards the datagram over QUIC;
/// - in: bytes from a peer's QUIC connection are sent from that peer's relay to chitchat's
///   socket, and `recv` maps the relay's address back to the peer's.
///
/// Datagrams on chitchat's socket from anything but a relay are discarded, so no plain UDP
/// sender can join: every gossip byte crossed a mutually authenticated QUIC connection.
pub struct Relays {
    peers: Arc<Peers>,
    /// What every incoming message passes before chitchat sees it.
    pub(super) screen: super::screen::Screen,
    inner_addr: SocketAddr,
    by_peer: Mutex<HashMap<SocketAddr, Arc<Relay>>>,
    by_relay: Mutex<HashMap<SocketAddr, SocketAddr>>,
    sends: Arc<Semaphore>,
}

pub struct Relay {
    socket: Arc<tokio::net::UdpSocket>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Relays {
    fn relay(self: &Arc<Self>, peer: SocketAddr) -> anyhow::Result<Arc<Relay>> {
        if let Some(r) = self.by_peer.lock().unwrap().get(&peer) {
            return Ok(r.clone());
        }
        let std_sock = std::net::UdpSocket::bind("127.0.0.1:0")?;
        std_sock.set_nonblocking(true)?;
        let socket = Arc::new(tokio::net::UdpSocket::from_std(std_sock)?);
        let addr = socket.local_addr()?;
        let weak = Arc::downgrade(self);
        let s2 = socket.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_GOSSIP_BYTES];
            loop {
                let Ok((n, from)) = s2.recv_from(&mut buf).await else { return };
                let Some(relays) = weak.upgrade() else { return };
                if from != relays.inner_addr {
                    continue;
                }
                relays.send_quic(peer, buf[..n].to_vec());
            }
        });
        let r = Arc::new(Relay { socket, task });
        self.by_peer.lock().unwrap().insert(peer, r.clone());
        self.by_relay.lock().unwrap().insert(addr, peer);
        Ok(r)
    }

    /// Sends one gossip message to `to` on a uni stream, without blocking the caller.
    fn send_quic(&self, to: SocketAddr, bytes: Vec<u8>) {
        let Ok(permit) = self.sends.clone().try_acquire_owned() else {
            tracing::debug!(%to, "gossip send dropped: too many in flight");
            return;
        };
        let peers = self.peers.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let r = tokio::time::timeout(SEND_TIMEOUT, async {
                let conn = peers.connect(to).await?;
                let mut s = conn.open_uni().await?;
                s.write_all(&bytes).await?;
                s.finish()?;
                anyhow::Ok(())
            })
            .await;
            if !matches!(r, Ok(Ok(()))) {
                peers.forget(to);
                tracing::trace!(%to, "gossip send failed");
            }
        });
    }

    /// Hands a gossip message that arrived over QUIC from `peer` to chitchat, if it passes
    /// the [screen](super::screen).
    pub async fn deliver(self: &Arc<Self>, peer: SocketAddr, bytes: &[u8]) {
        let Some(bytes) = self.screen.admit(bytes, peer).await else { return };
        if let Ok(r) = self.relay(peer) {
            // A full socket buffer drops it; gossip repairs loss on the next round.
            let _ = r.socket.send_to(&bytes, self.inner_addr).await;
        }
    }

    pub fn clear(&self) {
        self.by_peer.lock().unwrap().clear();
        self.by_relay.lock().unwrap().clear();
    }

    /// Closes the relays of peers not in `keep` (dead nodes, old addresses): a node that
    /// restarts many times does not leave a socket behind each time.
    pub fn retain(&self, keep: &std::collections::HashSet<SocketAddr>) {
        self.by_peer.lock().unwrap().retain(|a, _| keep.contains(a));
        self.by_relay.lock().unwrap().retain(|_, p| keep.contains(p));
    }

    /// Relay sockets open now.
    pub fn len(&self) -> usize {
        self.by_peer.lock().unwrap().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The chitchat [`Transport`] over QUIC (through [`Relays`]).
pub struct QuicTransport {
    local: SocketAddr,
    relays: Arc<Relays>,
    inner: Mutex<Option<chitchat::transport::UdpSocket>>,
}

impl QuicTransport {
    /// The transport, and the relays the accept loop delivers incoming gossip to.
    pub async fn new(peers: Arc<Peers>, local: SocketAddr, policy: super::screen::Policy) -> anyhow::Result<(Self, Arc<Relays>)> {
        let inner = chitchat::transport::UdpSocket::open("127.0.0.1:0".parse().unwrap()).await?;
        let inner_addr = inner.local_addr()?;
        let relays = Arc::new(Relays {
            peers,
            screen: super::screen::Screen::new(policy),
            inner_addr,
            by_peer: Mutex::new(HashMap::new()),
            by_relay: Mutex::new(HashMap::new()),
            sends: Arc::new(Semaphore::new(MAX_SENDS_IN_FLIGHT)),
        });
        Ok((QuicTransport { local, relays: relays.clone(), inner: Mutex::new(Some(inner)) }, relays))
    }
}

#[async_trait]
impl Transport for QuicTransport {
    async fn open(&self, _listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let inner = self.inner.lock().unwrap().take().ok_or_else(|| anyhow::anyhow!("the QUIC gossip socket is already open"))?;
        Ok(Box::new(QuicSocket { local: self.local, relays: self.relays.clone(), inner }))
    }
}

struct QuicSocket {
    local: SocketAddr,
    relays: Arc<Relays>,
    inner: chitchat::transport::UdpSocket,
}

#[async_trait]
impl Socket for QuicSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.local)
    }

    async fn send(&mut self, to: SocketAddr, envelope: ChitchatEnvelope) -> anyhow::Result<SendOutcome> {
        let relay = match self.relays.relay(to) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(%to, error = %e, "no gossip relay");
                return Ok(SendOutcome { num_bytes_sent: 0 });
            }
        };
        let addr = relay.socket.local_addr()?;
        self.inner.send(addr, envelope).await
    }

    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            let mut out = self.inner.recv().await?;
            let peer = self.relays.by_relay.lock().unwrap().get(&out.from_addr).copied();
            match peer {
                Some(p) => {
                    out.from_addr = p;
                    return Ok(out);
                }
                None => tracing::warn!(from = %out.from_addr, "discarded a gossip datagram that did not come through QUIC"),
            }
        }
    }
}
