//! The cluster's certificate authority and mutual TLS for QUIC between nodes.
//!
//! `zerolayer cluster init` ([`init`]) makes a CA and one certificate per node with rcgen. Each
//! node presents its certificate as a server *and* as a client, and requires the peer's to chain
//! to the cluster CA: a peer without one cannot open a connection, so it can neither gossip
//! (join) nor submit work. Every node certificate also names [`SERVER_NAME`], the name nodes
//! dial, so any node can dial any address learned from gossip.
//!
//! Files in the TLS directory: `ca.pem` (trusted by every node), `ca.key` (keep it offline; it
//! is needed only to add nodes), and `<node>.pem` + `<node>.key` per node.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The DNS name every node certificate carries, and the name nodes dial.
pub const SERVER_NAME: &str = "zerolayer.cluster";
/// ALPN protocol id of zerolayer's inter-node QUIC.
pub const ALPN: &[u8] = b"zerolayer/1";

fn ca_params() -> anyhow::Result<CertificateParams> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name.push(DnType::CommonName, "zerolayer cluster CA");
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    Ok(p)
}

/// Creates (or extends) a cluster CA in `out` and writes a certificate and key for each node.
/// An existing `ca.key` is reused, so running it again with new node ids adds nodes to the same
/// cluster. A node whose key exists already is refused unless `force` (which replaces its key
/// and certificate). Private keys are created with mode 0600 from the start. Returns the files
/// written.
pub fn init(out: &Path, nodes: &[String], force: bool) -> anyhow::Result<Vec<PathBuf>> {
    if nodes.is_empty() {
        bail!("name at least one node (--nodes n1,n2,n3)");
    }
    for n in nodes {
        if n.is_empty() || !n.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') {
            bail!("node id {n:?}: use letters, digits and '-' (it becomes a DNS name in the certificate)");
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    for n in nodes {
        let key = out.join(format!("{n}.key"));
        if key.exists() && !force {
            bail!("{} exists: node {n} already has a key (pass --force to replace it)", key.display());
        }
    }
    let mut written = Vec::new();
    let ca_key_path = out.join("ca.key");
    let ca_key = if ca_key_path.exists() {
        KeyPair::from_pem(&std::fs::read_to_string(&ca_key_path)?).context("reading ca.key")?
    } else {
        let k = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&k)?;
        write_private(&ca_key_path, &k.serialize_pem())?;
        std::fs::write(out.join("ca.pem"), cert.pem())?;
        written.push(out.join("ca.pem"));
        written.push(ca_key_path.clone());
        k
    };
    let issuer = Issuer::new(ca_params()?, ca_key);
    for n in nodes {
        let mut p = CertificateParams::new(vec![n.clone(), SERVER_NAME.to_string()])?;
        p.distinguished_name.push(DnType::CommonName, n.as_str());
        p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &issuer)?;
        std::fs::write(out.join(format!("{n}.pem")), cert.pem())?;
        write_private(&out.join(format!("{n}.key")), &key.serialize_pem())?;
        written.push(out.join(format!("{n}.pem")));
        written.push(out.join(format!("{n}.key")));
    }
    Ok(written)
}

/// Writes a private key to a new file that only its owner can read (mode 0600 from creation,
/// never a moment world-readable). An existing file is replaced (the caller checked `--force`).
fn write_private(path: &Path, pem: &str) -> anyhow::Result<()> {
    use std::io::Write as _;
    if path.exists() {
        std::fs::remove_file(path).with_context(|| format!("replacing {}", path.display()))?;
    }
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(pem.as_bytes())?;
    Ok(())
}

/// One node's TLS identity and the cluster CA.
pub struct TlsMaterial {
    pub ca: CertificateDer<'static>,
    pub chain: Vec<CertificateDer<'static>>,
    pub key: PrivateKeyDer<'static>,
}

impl Clone for TlsMaterial {
    fn clone(&self) -> Self {
        TlsMaterial { ca: self.ca.clone(), chain: self.chain.clone(), key: self.key.clone_key() }
    }
}

impl TlsMaterial {
    /// Reads `ca.pem`, `<node>.pem` and `<node>.key` from `dir`.
    pub fn load(dir: &Path, node: &str) -> anyhow::Result<Self> {
        let ca_path = dir.join("ca.pem");
        let ca = CertificateDer::from_pem_file(&ca_path).with_context(|| format!("reading {}", ca_path.display()))?;
        let cert_path = dir.join(format!("{node}.pem"));
        let chain = CertificateDer::pem_file_iter(&cert_path)
            .with_context(|| format!("reading {} (run `zerolayer cluster init`)", cert_path.display()))?
            .collect::<Result<Vec<_>, _>>()?;
        let key_path = dir.join(format!("{node}.key"));
        let key = PrivateKeyDer::from_pem_file(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
        Ok(TlsMaterial { ca, chain, key })
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn roots(ca: &CertificateDer<'static>) -> anyhow::Result<Arc<rustls::RootCertStore>> {
    let mut r = rustls::RootCertStore::empty();
    r.add(ca.clone()).context("adding the cluster CA")?;
    Ok(Arc::new(r))
}

/// QUIC transport limits shared by both directions.
pub fn transport_config(idle_timeout: Duration) -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(Some(idle_timeout.try_into().expect("idle timeout fits QUIC's varint")));
    t.keep_alive_interval(Some(idle_timeout / 3));
    // Bounded: at most this many forwarded requests per peer connection at once (more wait for
    // a stream credit), and gossip messages in flight.
    t.max_concurrent_bidi_streams(1024u32.into());
    t.max_concurrent_uni_streams(256u32.into());
    // A KV transfer is tens of MB on one stream: windows large enough that flow control does
    // not pace it (the memory is bounded: at most this much is buffered per stream/connection).
    t.stream_receive_window((16u32 << 20).into());
    t.receive_window((64u32 << 20).into());
    t.send_window(64 << 20);
    Arc::new(t)
}

/// The server side: requires a client certificate chaining to the cluster CA.
pub fn server_config(m: &TlsMaterial, idle_timeout: Duration) -> anyhow::Result<quinn::ServerConfig> {
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots(&m.ca)?, provider()).build()?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(m.chain.clone(), m.key.clone_key())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(quinn::crypto::rustls::QuicServerConfig::try_from(tls)?));
    cfg.transport_config(transport_config(idle_timeout));
    Ok(cfg)
}

/// The client side: presents this node's certificate and trusts only the cluster CA.
pub fn client_config(m: &TlsMaterial, idle_timeout: Duration) -> anyhow::Result<quinn::ClientConfig> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(roots(&m.ca)?)
        .with_client_auth_cert(m.chain.clone(), m.key.clone_key())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut cfg = quinn::ClientConfig::new(Arc::new(quinn::crypto::rustls::QuicClientConfig::try_from(tls)?));
    cfg.transport_config(transport_config(idle_timeout));
    Ok(cfg)
}

/// A QUIC endpoint on `socket` that serves and dials with mutual TLS.
pub fn endpoint(socket: std::net::UdpSocket, m: &TlsMaterial, idle_timeout: Duration) -> anyhow::Result<quinn::Endpoint> {
    let mut ep = quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(server_config(m, idle_timeout)?),
        socket,
        Arc::new(quinn::TokioRuntime),
    )?;
    ep.set_default_client_config(client_config(m, idle_timeout)?);
    Ok(ep)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_private_and_never_overwritten_without_force() {
        let dir = std::env::temp_dir().join(format!("zl-tls-init-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        init(&dir, &["n1".into()], false).unwrap();
        #[cfg(unix)]
        for f in ["ca.key", "n1.key"] {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(std::fs::metadata(dir.join(f)).unwrap().permissions().mode() & 0o777, 0o600, "{f}");
        }
        let before = std::fs::read(dir.join("n1.key")).unwrap();
        let e = init(&dir, &["n1".into()], false).unwrap_err();
        assert!(e.to_string().contains("--force"), "{e}");
        assert_eq!(std::fs::read(dir.join("n1.key")).unwrap(), before, "untouched");
        // More nodes under the same CA; --force replaces an existing node's key.
        let ca = std::fs::read(dir.join("ca.key")).unwrap();
        init(&dir, &["n2".into()], false).unwrap();
        init(&dir, &["n1".into()], true).unwrap();
        assert_ne!(std::fs::read(dir.join("n1.key")).unwrap(), before);
        assert_eq!(std::fs::read(dir.join("ca.key")).unwrap(), ca, "the CA key is reused");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
