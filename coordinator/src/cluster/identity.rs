//! Node identity: who a peer is, proven by its certificate, never by what it says.
//!
//! Every node certificate from `zerolayer cluster init` names its node id (a DNS name in the
//! certificate) and chains to the cluster CA. So:
//! - a QUIC connection's peer is the node its certificate names ([`cert_names`]); a frame that
//!   claims another origin (a forwarded request, a KV transfer) is refused;
//! - a node signs every value it gossips with its certificate's key ([`Signer`]), over its id,
//!   its generation, its gossip address, the key and the value, and publishes the certificate
//!   itself (key `cert`);
//!   a reader accepts a node's values only under a certificate that chains to the CA and names
//!   that node, with a valid signature ([`Verifier`]). A certificate holder can relay gossip
//!   (scuttlebutt does) but cannot write values as another node: it cannot impersonate a node,
//!   mark it dead, or advertise a cache for it. A generation counts only once it carries a
//!   value signed for it (the publisher's `state`), so a replayed certificate under a newer
//!   generation, or a node's values under another address, evict or redirect nothing.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::sign::SigningKey;

/// The gossip key holding a node's certificate (hex of its DER).
pub const KEY_CERT: &str = "cert";

/// Whether `cert` (a node certificate) names `node`.
pub fn cert_names(cert: &CertificateDer<'_>, node: &str) -> bool {
    let Ok(ee) = webpki::EndEntityCert::try_from(cert) else { return false };
    let Ok(name) = ServerName::try_from(node) else { return false };
    ee.verify_is_valid_for_subject_name(&name).is_ok()
}

/// What a node signs for one gossiped value.
fn message(node: &str, generation: u64, addr: SocketAddr, key: &str, payload: &str) -> Vec<u8> {
    format!("zerolayer-gossip\0{node}\0{generation}\0{addr}\0{key}\0{payload}").into_bytes()
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if b.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    b.chunks_exact(2).map(|p| Some(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

/// Signs this node's gossip with its certificate's key.
pub struct Signer {
    node: String,
    generation: u64,
    addr: SocketAddr,
    key: Arc<dyn SigningKey>,
    cert_hex: String,
}

impl Signer {
    pub fn new(node: &str, generation: u64, addr: SocketAddr, cert: &CertificateDer<'_>, key: &PrivateKeyDer<'_>) -> anyhow::Result<Self> {
        let key = rustls::crypto::aws_lc_rs::sign::any_ecdsa_type(key).map_err(|e| anyhow::anyhow!("node key: {e}"))?;
        Ok(Signer { node: node.to_string(), generation, addr, key, cert_hex: hex(cert) })
    }

    /// The value of [`KEY_CERT`].
    pub fn cert(&self) -> &str {
        &self.cert_hex
    }

    /// `payload` signed for `key`: `payload|signature` (hex).
    pub fn sign(&self, key: &str, payload: &str) -> String {
        let signer = self.key.choose_scheme(&[rustls::SignatureScheme::ECDSA_NISTP256_SHA256]).expect("an ECDSA P-256 node key");
        let sig = signer.sign(&message(&self.node, self.generation, self.addr, key, payload)).unwrap_or_default();
        format!("{payload}|{}", hex(&sig))
    }
}

/// Signature outcomes by (node, generation, key): the value's keyed hash, and whether it held.
type Checked = HashMap<(String, u64, String), (u64, bool)>;

/// Signature checks remembered at most; past it the memory starts over (a peer inventing keys
/// costs checks again, never memory).
pub const MAX_CHECKED: usize = 16_384;

/// Checks other nodes' certificates and signatures. Keeps the certificates it has accepted
/// (one per node generation, bounded by what the caller retains), and the outcome of the last
/// signature check of each (node, generation, key), so that a value is verified once, not at
/// every read of the gossip state (every publisher round): junk signatures cost one check each,
/// not one per round under the gossip lock.
pub struct Verifier {
    ca: CertificateDer<'static>,
    /// (node, generation) → the certificate offered (its hex), and the parsed certificate if
    /// it was accepted. A different certificate offered later is checked again.
    certs: HashMap<(String, u64), (String, Option<CertificateDer<'static>>)>,
    /// (node, generation, key) → a keyed hash of the value last checked, and whether its
    /// signature held. The hash's key is this process's own, so no peer can aim a value at
    /// another's entry.
    checked: Mutex<Checked>,
    hasher: std::collections::hash_map::RandomState,
    /// Signatures verified so far (for tests and the link's stats).
    checks: AtomicU64,
}

impl Verifier {
    pub fn new(ca: CertificateDer<'static>) -> Self {
        Verifier { ca, certs: HashMap::new(), checked: Mutex::new(HashMap::new()), hasher: Default::default(), checks: AtomicU64::new(0) }
    }

    /// Whether `cert_hex` is a certificate from the cluster CA naming `node`: the condition for
    /// any of `node`'s values to be read. Remembered per generation.
    pub fn accept_cert(&mut self, node: &str, generation: u64, cert_hex: &str) -> bool {
        if cert_hex.is_empty() {
            return false; // not gossiped yet
        }
        let key = (node.to_string(), generation);
        if let Some((h, ok)) = self.certs.get(&key) {
            if h == cert_hex {
                return ok.is_some();
            }
        }
        let ok = unhex(cert_hex).map(CertificateDer::from).filter(|c| self.chains_to_ca(c) && cert_names(c, node));
        let accepted = ok.is_some();
        self.certs.insert(key, (cert_hex.to_string(), ok));
        accepted
    }

    fn chains_to_ca(&self, cert: &CertificateDer<'_>) -> bool {
        let Ok(anchor) = webpki::anchor_from_trusted_cert(&self.ca) else { return false };
        let Ok(ee) = webpki::EndEntityCert::try_from(cert) else { return false };
        ee.verify_for_usage(
            &[webpki::aws_lc_rs::ECDSA_P256_SHA256],
            &[anchor],
            &[],
            UnixTime::now(),
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .is_ok()
    }

    /// `node`'s value for `key`, if its signature holds under the certificate accepted for
    /// `(node, generation)`, for the gossip address `addr`.
    pub fn open<'v>(&self, node: &str, generation: u64, addr: SocketAddr, key: &str, value: &'v str) -> Option<&'v str> {
        let Some((_, Some(cert))) = self.certs.get(&(node.to_string(), generation)) else { return None };
        let (payload, sig) = value.rsplit_once('|')?;
        let at = (node.to_string(), generation, key.to_string());
        let h = self.hasher.hash_one((addr, value));
        let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(seen, ok)) = checked.get(&at) {
            if seen == h {
                return ok.then_some(payload);
            }
        }
        self.checks.fetch_add(1, Ordering::Relaxed);
        let ok = unhex(sig).is_some_and(|sig| {
            webpki::EndEntityCert::try_from(cert)
                .is_ok_and(|ee| ee.verify_signature(webpki::aws_lc_rs::ECDSA_P256_SHA256, &message(node, generation, addr, key, payload), &sig).is_ok())
        });
        if checked.len() >= MAX_CHECKED {
            checked.clear();
        }
        checked.insert(at, (h, ok));
        ok.then_some(payload)
    }

    /// Signatures verified so far (a value read again unchanged is not verified again).
    pub fn checks(&self) -> u64 {
        self.checks.load(Ordering::Relaxed)
    }

    /// Forgets every generation not in `keep`.
    pub fn retain(&mut self, keep: &std::collections::HashSet<(String, u64)>) {
        self.certs.retain(|k, _| keep.contains(k));
        self.checked.get_mut().unwrap_or_else(|e| e.into_inner()).retain(|(n, g, _), _| keep.contains(&(n.clone(), *g)));
    }

    pub fn len(&self) -> usize {
        self.certs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.certs.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn material(dir: &std::path::Path, node: &str) -> super::super::tls::TlsMaterial {
        super::super::tls::TlsMaterial::load(dir, node).unwrap()
    }

    const ADDR: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7000);

    #[test]
    fn signatures_bind_node_generation_key_and_value() {
        let dir = std::env::temp_dir().join(format!("zl-identity-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        super::super::tls::init(&dir, &["a".into(), "b".into()], false).unwrap();
        let (a, b) = (material(&dir, "a"), material(&dir, "b"));
        assert!(cert_names(&a.chain[0], "a") && !cert_names(&a.chain[0], "b"));
        let signer = Signer::new("a", 7, ADDR, &a.chain[0], &a.key).unwrap();
        let mut v = Verifier::new(a.ca.clone());
        assert!(v.accept_cert("a", 7, signer.cert()));
        let signed = signer.sign("state", "ready");
        assert_eq!(v.open("a", 7, ADDR, "state", &signed), Some("ready"));
        // The same signature says nothing for another key, value, node or generation.
        assert_eq!(v.open("a", 7, ADDR, "http", &signed), None);
        assert_eq!(v.open("a", 7, ADDR, "state", &signed.replacen("ready", "dead", 1)), None);
        assert_eq!(v.open("a", 8, ADDR, "state", &signed), None, "no certificate accepted for generation 8");
        assert_eq!(v.open("a", 7, ADDR, "state", "ready"), None, "unsigned");
        let elsewhere: SocketAddr = "127.0.0.1:7001".parse().unwrap();
        assert_eq!(v.open("a", 7, elsewhere, "state", &signed), None, "a's value under another address");
        assert_eq!(v.open("a", 7, ADDR, "state", &signed), Some("ready"), "and the remembered outcome is per address");
        assert_eq!(v.open("a", 7, elsewhere, "state", &signed), None);
        assert_eq!(v.open("a", 7, ADDR, "state", "ready|zz"), None, "not hex");
        // b's certificate cannot speak for a, and a self-made certificate is not from the CA.
        let forger = Signer::new("a", 9, ADDR, &b.chain[0], &b.key).unwrap();
        assert!(!v.accept_cert("a", 9, forger.cert()), "b's certificate does not name a");
        assert_eq!(v.open("a", 9, ADDR, "state", &forger.sign("state", "dead")), None);
        let other = dir.join("other");
        super::super::tls::init(&other, &["a".into()], false).unwrap();
        let foreign = material(&other, "a");
        assert!(!v.accept_cert("a", 10, &hex(&foreign.chain[0])), "another CA's certificate for a");
        assert!(!v.accept_cert("a", 11, "zz"));
        v.retain(&[("a".to_string(), 7)].into_iter().collect());
        assert_eq!(v.len(), 1);
        // A value read again unchanged is not verified again, valid or not; a changed one is.
        let before = v.checks();
        for _ in 0..100 {
            assert_eq!(v.open("a", 7, ADDR, "state", &signed), Some("ready"));
            assert_eq!(v.open("a", 7, ADDR, "http", &signed), None);
        }
        assert!(v.checks() <= before + 2, "{} checks for 200 reads of two values", v.checks() - before);
        let forged = signed.replacen("ready", "dead", 1);
        assert_eq!(v.open("a", 7, ADDR, "state", &forged), None, "a new value is verified");
        assert_eq!(v.open("a", 7, ADDR, "state", &signed), Some("ready"), "and the old one again");
        let later = signer.sign("state", "draining");
        assert_eq!(v.open("a", 7, ADDR, "state", &later), Some("draining"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
