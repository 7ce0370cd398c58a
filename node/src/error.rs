//! The worker crate's error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum WorkerError {
    #[error("model: {0}")]
    Model(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("request is too long: {needed} tokens exceed the limit of {limit}")]
    TooLong { needed: usize, limit: usize },
    #[error("worker queue is full ({0} waiting)")]
    QueueFull(usize),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("grammar: {0}")]
    Grammar(String),
    #[error("worker is shutting down")]
    ShuttingDown,
    /// The backend can run no more steps (a rank of its tensor-parallel group is gone): its
    /// sequences end `Lost`, so that their coordinators continue them on another worker.
    #[error("worker unavailable: {0}")]
    Unavailable(String),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl WorkerError {
    pub fn candle(e: candle_core::Error) -> Self {
        WorkerError::Model(e.to_string())
    }

    /// A stable name, usable as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            WorkerError::Model(_) => "model",
            WorkerError::Tokenizer(_) => "tokenizer",
            WorkerError::Template(_) => "template",
            WorkerError::TooLong { .. } => "too_long",
            WorkerError::QueueFull(_) => "queue_full",
            WorkerError::Invalid(_) => "invalid",
            WorkerError::Grammar(_) => "grammar",
            WorkerError::ShuttingDown => "shutting_down",
            WorkerError::Unavailable(_) => "unavailable",
            WorkerError::Io(_) => "io",
        }
    }
}

pub type Result<T> = std::result::Result<T, WorkerError>;
