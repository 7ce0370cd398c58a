//! Fuzz target: bytes from a peer → the gossip screen (chitchat's wire format read by our own
//! decoder, then every check). `cargo fuzz run gossip` (see scripts/fuzz). Nothing panics, a
//! stream never inflates past its budget, and a message the screen reads writes back to
//! bytes that read as the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use zerolayer_coordinator::cluster::screen::wire::{self, Id};
use zerolayer_coordinator::cluster::screen::{check, Known, Policy};

/// chitchat holding one node state, `b` generation 1, with one key.
struct One;

impl Known for One {
    fn node_states(&self) -> usize {
        1
    }
    fn knows(&self, id: &Id) -> bool {
        id.node == "b" && id.generation == 1
    }
    fn keys(&self, id: &Id) -> usize {
        usize::from(self.knows(id))
    }
    fn has_key(&self, id: &Id, key: &str) -> bool {
        self.knows(id) && key == "state"
    }
}

fuzz_target!(|data: &[u8]| {
    let policy = Policy { me: "a".into(), generation: 2, configured: vec!["a".into(), "b".into()], allow_join: data.first() == Some(&0) };
    let _ = check(data, &policy, &One);
    if let Ok(m) = wire::decode(data) {
        assert_eq!(wire::decode(&wire::write::encode(&m)), Ok(m));
    }
});
