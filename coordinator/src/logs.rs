//! Log lines as they leave the process. Every formatted line, at every level and in either
//! format, passes the redactor before it is written: what `[logging]` names (emails and phone
//! numbers by default, more kinds and custom patterns on request) is masked, so client text that
//! reaches a log line (a refused request's error, a debug line's prompt) never lands in a log
//! store as it was sent.
//!
//! The redactor is process-wide: the default until a node starts, then its config's.

use std::borrow::Cow;
use std::io::{self, Write};
use std::sync::{Arc, OnceLock, RwLock};

use regex::Regex;
use tracing_subscriber::fmt::MakeWriter;
use zerolayer_common::config::LoggingSection;

/// The patterns masked in log lines, each with its mask.
pub struct Redactor {
    rules: Vec<(Regex, &'static str)>,
}

impl Redactor {
    pub fn new(cfg: &LoggingSection) -> Result<Self, String> {
        let rules = cfg.rules().into_iter().map(|(p, mask)| Ok((zerolayer_common::config::compile_pattern(&p).map_err(|e| format!("{p:?}: {e}"))?, mask)));
        Ok(Redactor { rules: rules.collect::<Result<_, String>>()? })
    }

    /// `s` with every match masked.
    pub fn redact<'a>(&self, s: &'a str) -> Cow<'a, str> {
        let mut out = Cow::Borrowed(s);
        for (re, mask) in &self.rules {
            if let Cow::Owned(o) = re.replace_all(&out, *mask) {
                out = Cow::Owned(o);
            }
        }
        out
    }
}

fn current() -> &'static RwLock<Arc<Redactor>> {
    static R: OnceLock<RwLock<Arc<Redactor>>> = OnceLock::new();
    R.get_or_init(|| RwLock::new(Arc::new(Redactor::new(&LoggingSection::default()).expect("the default patterns compile"))))
}

/// Makes `cfg` the redactor of every later log line.
pub fn configure(cfg: &LoggingSection) -> anyhow::Result<()> {
    let r = Redactor::new(cfg).map_err(|e| anyhow::anyhow!("logging.patterns: {e}"))?;
    *current().write().unwrap_or_else(|e| e.into_inner()) = Arc::new(r);
    Ok(())
}

/// A writer maker whose writers hold one event's line and write it redacted when dropped.
pub struct Redacting<M>(pub M);

impl<'a, M: MakeWriter<'a>> MakeWriter<'a> for Redacting<M> {
    type Writer = Line<M::Writer>;
    fn make_writer(&'a self) -> Self::Writer {
        Line { buf: Vec::new(), out: self.0.make_writer() }
    }
}

/// One event's output, held until the formatter is done with it.
pub struct Line<W: Write> {
    buf: Vec<u8>,
    out: W,
}

impl<W: Write> Line<W> {
    fn emit(&mut self) -> io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&self.buf);
        let redactor = current().read().unwrap_or_else(|e| e.into_inner()).clone();
        let clean = redactor.redact(&text);
        let r = self.out.write_all(clean.as_bytes()).and_then(|_| self.out.flush());
        self.buf.clear();
        r
    }
}

impl<W: Write> Write for Line<W> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        self.emit()
    }
}

impl<W: Write> Drop for Line<W> {
    fn drop(&mut self) {
        let _ = self.emit();
    }
}

/// Installs the process's log subscriber: `filter` (an `EnvFilter` directive), text or JSON
/// lines, written redacted to `writer`.
pub fn init_with<W>(json: bool, filter: &str, writer: W)
where
    W: for<'a> MakeWriter<'a> + Send + Sync + 'static,
{
    let logs = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new(filter)).with_writer(Redacting(writer));
    if json {
        logs.json().with_current_span(true).with_span_list(false).init();
    } else {
        logs.init();
    }
}

/// The binary's logs: `RUST_LOG` (default `info`), on stdout (where a container's logs are
/// collected, and where `zerolayer up` has always written its ready line).
pub fn init(json: bool) {
    let filter = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
    init_with(json, &filter, io::stdout);
}

#[cfg(test)]
mod tests {
    use super::*;
    use zerolayer_common::config::Redaction;

    #[test]
    fn every_rule_masks_in_order() {
        let cfg = LoggingSection { redact: vec![Redaction::Email, Redaction::CreditCard], patterns: vec![r"ACCT-\d{4}".into()] };
        let r = Redactor::new(&cfg).unwrap();
        assert_eq!(r.redact("a@b.io paid 4111-1111-1111-1111 from ACCT-1234"), "[email] paid [credit_card] from [redacted]");
        assert!(matches!(r.redact("nothing here"), Cow::Borrowed(_)));
    }

    #[test]
    fn a_line_is_written_once_redacted() {
        let mut out = Vec::new();
        {
            let mut l = Line { buf: Vec::new(), out: &mut out };
            l.write_all(b"mail ").unwrap();
            l.write_all(b"x@y.org\n").unwrap();
        }
        assert_eq!(String::from_utf8(out).unwrap(), "mail [email]\n");
    }
}
