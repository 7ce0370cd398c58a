//! Wall-clock formatting: RFC 3339 timestamps (UTC, whole seconds) for the APIs' `created_at`
//! and the rate-limit `*-reset` headers, and Unix seconds. Pure calendar arithmetic, no I/O
//! beyond reading the system clock in [`unix_now`].

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// RFC 3339 (UTC, seconds, rounded up) for a system time.
pub fn rfc3339_system(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64 + i64::from(d.subsec_nanos() > 0)).unwrap_or(0);
    rfc3339(secs)
}

/// RFC 3339 (UTC, seconds) for Unix seconds.
pub fn rfc3339(unix: i64) -> String {
    // Civil-from-days (Howard Hinnant), UTC.
    let days = unix.div_euclid(86400);
    let secs = unix.rem_euclid(86400);
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", secs / 3600, secs % 3600 / 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_798_761_599), "2026-12-31T23:59:59Z");
        assert_eq!(rfc3339(-1), "1969-12-31T23:59:59Z");
        let t = UNIX_EPOCH + std::time::Duration::from_millis(1500);
        assert_eq!(rfc3339_system(t), "1970-01-01T00:00:02Z", "rounded up to the next second");
    }
}
