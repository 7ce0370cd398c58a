//! One token bucket: `per_minute` units of capacity, refilled continuously at `per_minute / 60`
//! a second. Unlike a GCRA limiter it can go into debt: charges a node learns of late (another
//! node's, through gossip) are taken whether or not they fit, and are paid back before
//! anything else is admitted. Pure: every method takes `now`.

use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct Bucket {
    per_minute: u32,
    level: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket; `None` for 0 (unlimited).
    pub fn new(per_minute: u32, now: Instant) -> Option<Bucket> {
        (per_minute > 0).then_some(Bucket { per_minute, level: per_minute as f64, at: now })
    }

    pub fn per_minute(&self) -> u32 {
        self.per_minute
    }

    fn rate(&self) -> f64 {
        self.per_minute as f64 / 60.0
    }

    fn refill(&mut self, now: Instant) {
        if now > self.at {
            let dt = now.duration_since(self.at).as_secs_f64();
            self.level = (self.level + dt * self.rate()).min(self.per_minute as f64);
            self.at = now;
        }
    }

    /// How long until `n` units fit: zero if they fit now, `None` if they never will (more than
    /// the whole capacity).
    pub fn wait_for(&mut self, n: f64, now: Instant) -> Option<Duration> {
        if n > self.per_minute as f64 {
            return None;
        }
        self.refill(now);
        let short = n - self.level;
        Some(if short <= 0.0 { Duration::ZERO } else { Duration::from_secs_f64(short / self.rate()) })
    }

    /// Takes `n` units, into debt if need be. Debt is bounded by one whole capacity, so that no
    /// report (however large) locks a key out for more than two minutes.
    pub fn take(&mut self, n: f64, now: Instant) {
        self.refill(now);
        self.level = (self.level - n).max(-(self.per_minute as f64));
    }

    /// Whole units left now (0 while in debt).
    pub fn remaining(&mut self, now: Instant) -> u32 {
        self.refill(now);
        self.level.max(0.0).floor() as u32
    }

    /// How long until the bucket is full again.
    pub fn full_in(&mut self, now: Instant) -> Duration {
        self.refill(now);
        Duration::from_secs_f64(((self.per_minute as f64 - self.level) / self.rate()).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refills_continuously_and_pays_debt_first() {
        let t0 = Instant::now();
        let mut b = Bucket::new(6, t0).unwrap();
        assert!(Bucket::new(0, t0).is_none());
        for _ in 0..6 {
            assert_eq!(b.wait_for(1.0, t0), Some(Duration::ZERO));
            b.take(1.0, t0);
        }
        assert_eq!(b.remaining(t0), 0);
        // 6 a minute: one more every 10 s.
        assert_eq!(b.wait_for(1.0, t0), Some(Duration::from_secs(10)));
        assert_eq!(b.wait_for(7.0, t0), None);
        // A late charge of 3 (another node's) puts it 3 in debt: 40 s until one fits.
        b.take(3.0, t0);
        assert_eq!(b.wait_for(1.0, t0), Some(Duration::from_secs(40)));
        assert_eq!(b.remaining(t0 + Duration::from_secs(30)), 0);
        assert_eq!(b.remaining(t0 + Duration::from_secs(40)), 1);
        assert_eq!(b.full_in(t0 + Duration::from_secs(40)), Duration::from_secs(50));
        // Debt never passes one capacity.
        b.take(1e9, t0 + Duration::from_secs(40));
        assert_eq!(b.wait_for(1.0, t0 + Duration::from_secs(40)), Some(Duration::from_secs(70)));
        // Full again, and no fuller.
        assert_eq!(b.remaining(t0 + Duration::from_secs(3600)), 6);
    }
}
