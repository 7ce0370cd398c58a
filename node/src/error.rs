//! The node crate's error type.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum NodeError {
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
    #[error("worker is shutting down")]
    ShuttingDown,
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
}

impl NodeError {
    pub fn candle(e: candle_core::Error) -> Self {
        NodeError::Model(e.to_string())
    }

    /// A stable name, usable as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            NodeError::Model(_) => "model",
            NodeError::Tokenizer(_) => "tokenizer",
            NodeError::Template(_) => "template",
            NodeError::TooLong { .. } => "too_long",
            NodeError::QueueFull(_) => "queue_full",
            NodeError::Invalid(_) => "invalid",
            NodeError::ShuttingDown => "shutting_down",
            NodeError::Io(_) => "io",
        }
    }
}

pub type Result<T> = std::result::Result<T, NodeError>;
