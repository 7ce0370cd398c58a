//! The `zerolayer` binary's commands (the binary's own modules, not the library's).

pub mod admin;
pub mod up;
