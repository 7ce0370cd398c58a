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

/// How long node certificates last unless `cluster init --days` says otherwise; a new CA
/// lasts ten times as long.
pub const DEFAULT_DAYS: u32 = 365;

/// The civil date (year, month, day) of day `z` since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i32, u8, u8) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u8;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u8;
    let y = (yoe + era * 400 + i64::from(m <= 2)) as i32;
    (y, m, d)
}

/// Valid from yesterday (clocks differ) for `days` days from today.
fn set_lifetime(p: &mut CertificateParams, days: u32) {
    let today = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() / 86_400).unwrap_or(0) as i64;
    let (y, m, d) = civil_from_days(today - 1);
    p.not_before = rcgen::date_time_ymd(y, m, d);
    let (y, m, d) = civil_from_days(today + i64::from(days));
    p.not_after = rcgen::date_time_ymd(y, m, d);
}

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
    init_valid_for(out, nodes, force, DEFAULT_DAYS)
}

/// [`init`] with node certificates valid for `days` days (a new CA for `10 × days`).
pub fn init_valid_for(out: &Path, nodes: &[String], force: bool, days: u32) -> anyhow::Result<Vec<PathBuf>> {
    if days == 0 {
        bail!("--days must be at least 1");
    }
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
        let mut params = ca_params()?;
        set_lifetime(&mut params, days.saturating_mul(10));
        let cert = params.self_signed(&k)?;
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
        set_lifetime(&mut p, days);
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
    /// Reads `ca.pem`, `<node>.pem` and `<node>.key` from `dir` (what `cluster init` writes),
    /// or, where `<node>.pem` is absent and `tls.crt` present, the layout of a Kubernetes TLS
    /// secret and cert-manager's CSI driver: `ca.crt`, `tls.crt`, `tls.key`, issued per pod.
    /// That certificate must name `node`, since peers will hold this node to that name.
    pub fn load(dir: &Path, node: &str) -> anyhow::Result<Self> {
        let per_pod = !dir.join(format!("{node}.pem")).exists() && dir.join("tls.crt").exists();
        let (ca_file, cert_file, key_file) = if per_pod {
            ("ca.crt".to_string(), "tls.crt".to_string(), "tls.key".to_string())
        } else {
            ("ca.pem".to_string(), format!("{node}.pem"), format!("{node}.key"))
        };
        let ca_path = dir.join(ca_file);
        let ca = CertificateDer::from_pem_file(&ca_path).with_context(|| format!("reading {}", ca_path.display()))?;
        let cert_path = dir.join(cert_file);
        let chain = CertificateDer::pem_file_iter(&cert_path)
            .with_context(|| format!("reading {} (run `zerolayer cluster init`)", cert_path.display()))?
            .collect::<Result<Vec<_>, _>>()?;
        let key_path = dir.join(key_file);
        let key = PrivateKeyDer::from_pem_file(&key_path).with_context(|| format!("reading {}", key_path.display()))?;
        if per_pod && !chain.first().is_some_and(|c| super::identity::cert_names(c, node)) {
            bail!("{} does not name node {node:?}: issue it with the node id as a DNS name", cert_path.display());
        }
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
    use rustls::pki_types::UnixTime;

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

    #[test]
    fn certificates_last_the_days_asked() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        let dir = std::env::temp_dir().join(format!("zl-tls-days-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        init_valid_for(&dir, &["n1".into()], false, 30).unwrap();
        let m = TlsMaterial::load(&dir, "n1").unwrap();
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots(&m.ca).unwrap(), provider()).build().unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let valid_at = |days: u64| verifier.verify_client_cert(&m.chain[0], &[], UnixTime::since_unix_epoch(Duration::from_secs(now + days * 86_400))).is_ok();
        assert!(valid_at(0) && valid_at(29), "valid now and for the days asked");
        assert!(!valid_at(32), "and not past them");
        assert!(init_valid_for(&dir, &["n2".into()], false, 0).is_err());
        // cert-manager's layout (a pod's own tls.crt, tls.key and ca.crt) loads when it names
        // the node, and is refused for any other node.
        let pod = dir.join("pod");
        std::fs::create_dir_all(&pod).unwrap();
        for (from, to) in [("ca.pem", "ca.crt"), ("n1.pem", "tls.crt"), ("n1.key", "tls.key")] {
            std::fs::copy(dir.join(from), pod.join(to)).unwrap();
        }
        assert_eq!(TlsMaterial::load(&pod, "n1").unwrap().chain, m.chain);
        let e = TlsMaterial::load(&pod, "n2").err().unwrap().to_string();
        assert!(e.contains("does not name node \"n2\""), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
