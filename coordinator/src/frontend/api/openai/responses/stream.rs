//! A streamed response: the official event sequence, each event with its `sequence_number`.
//!
//! `response.created`, `response.in_progress`; for text, a message item
//! (`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`
//! per piece, then `.done`, `response.content_part.done`, `response.output_item.done`); for
//! each call, a `function_call` item (added, `response.function_call_arguments.delta` with
//! the whole arguments, `.done`, item done); then `response.completed` (or
//! `response.incomplete` at the length limit, `response.failed` on an error).

use axum::response::sse::Event;
use serde_json::{json, Value};
use zerolayer_common::{SeqEvent, StopReason, Usage};

use super::output::{call_item, message_item, output_text, status, Head};
use super::kept::Keep;
use crate::frontend::api::openai::logprobs::{chat_content, Namer};
use crate::frontend::api::shared::{failed, new_id, shut_down, AppState, Following, Next, SseStep};
use crate::frontend::service::Accepted;
use crate::error::ApiError;
use crate::frontend::tools::{CallParser, Calls, Piece};

/// The message item being written: its index among the output items, id, and text and
/// logprob entries so far.
struct Open {
    index: usize,
    id: String,
    text: String,
    logprobs: Vec<Value>,
}

/// One streamed response, one step at a time.
pub struct ResponseStream {
    seq: Following,
    head: Head,
    keep: Keep,
    parser: Option<CallParser>,
    /// Events sent so far (the next one's `sequence_number`).
    sent: u64,
    started: bool,
    /// The finished output items.
    items: Vec<Value>,
    open: Option<Open>,
    /// How logprobs name tokens, when the request asked for them.
    namer: Option<Namer>,
    /// Logprob entries of tokens whose text is not out yet (the call parser may hold it).
    pending: Vec<Value>,
}

impl ResponseStream {
    pub fn new(c: AppState, acc: Accepted, head: Head, keep: Keep, calls: &Calls, namer: Option<Namer>) -> Self {
        let parser = calls.parser();
        ResponseStream { seq: Following::new(c, acc), head, keep, parser, sent: 0, started: false, items: Vec::new(), open: None, namer, pending: Vec::new() }
    }

    fn event(&mut self, ty: &str, mut body: Value) -> Event {
        body["type"] = json!(ty);
        body["sequence_number"] = json!(self.sent);
        self.sent += 1;
        Event::default().event(ty).data(body.to_string())
    }

    /// The index the next item takes.
    fn next_index(&self) -> usize {
        self.items.len() + usize::from(self.open.is_some())
    }

    /// Starts a message item.
    fn open_message(&mut self, out: &mut Vec<Event>) {
        let (index, id) = (self.next_index(), new_id("msg_"));
        let mut item = message_item(&id, "", "in_progress");
        item["content"] = json!([]);
        out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
        out.push(self.event("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": output_text("")})));
        self.open = Some(Open { index, id, text: String::new(), logprobs: Vec::new() });
    }

    fn text(&mut self, t: String, out: &mut Vec<Event>) {
        if t.is_empty() || (self.open.is_none() && self.parser.is_some() && t.trim().is_empty()) {
            return;
        }
        if self.open.is_none() {
            self.open_message(out);
        }
        self.delta(t, out);
    }

    /// A text delta of the open message, with the logprob entries of the tokens it shows.
    fn delta(&mut self, t: String, out: &mut Vec<Event>) {
        let logprobs = std::mem::take(&mut self.pending);
        let open = self.open.as_mut().expect("a message is open");
        open.text.push_str(&t);
        open.logprobs.extend(logprobs.iter().cloned());
        let (id, index) = (open.id.clone(), open.index);
        out.push(self.event("response.output_text.delta", json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t, "logprobs": logprobs})));
    }

    /// Ends the open message item, if any.
    fn close(&mut self, out: &mut Vec<Event>) {
        let Some(Open { index, id, text, logprobs }) = self.open.take() else { return };
        let logprobs = Value::Array(logprobs);
        out.push(self.event("response.output_text.done", json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": logprobs})));
        let mut part = output_text(&text);
        part["logprobs"] = logprobs;
        out.push(self.event("response.content_part.done", json!({"item_id": id, "output_index": index, "content_index": 0, "part": part.clone()})));
        let mut item = message_item(&id, &text, "completed");
        item["content"] = json!([part]);
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.items.push(item);
    }

    fn call(&mut self, name: String, arguments: Value, out: &mut Vec<Event>) {
        // The tokens not shown as text yet wrote this call.
        self.pending.clear();
        self.close(out);
        let (index, id, call_id, args) = (self.items.len(), new_id("fc_"), new_id("call_"), arguments.to_string());
        out.push(self.event("response.output_item.added", json!({"output_index": index, "item": call_item(&id, &call_id, &name, "", "in_progress")})));
        out.push(self.event("response.function_call_arguments.delta", json!({"item_id": id, "output_index": index, "delta": args})));
        out.push(self.event("response.function_call_arguments.done", json!({"item_id": id, "output_index": index, "name": name, "arguments": args})));
        let item = call_item(&id, &call_id, &name, &args, "completed");
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.items.push(item);
    }

    fn pieces(&mut self, pieces: Vec<Piece>, out: &mut Vec<Event>) {
        for p in pieces {
            match p {
                Piece::Text(t) => self.text(t, out),
                Piece::Call { name, arguments } => self.call(name, arguments, out),
            }
        }
    }

    fn finish(&mut self, reason: &StopReason, usage: &Usage, out: &mut Vec<Event>) {
        let rest = self.parser.as_mut().map(CallParser::finish).unwrap_or_default();
        self.pieces(rest, out);
        if self.items.is_empty() && self.open.is_none() {
            // A reply with no text at all is still one (empty) message, as when not streamed.
            self.open_message(out);
        }
        // Tokens with no text of their own (an end token) still belong to the message: a last,
        // empty delta carries them, as Chat's last chunk does.
        if self.open.is_some() && !self.pending.is_empty() {
            self.delta(String::new(), out);
        }
        self.close(out);
        let (state, incomplete) = status(reason);
        let mut response = self.head.object(state, incomplete, std::mem::take(&mut self.items), Some(usage));
        self.keep.keep(&self.seq.c, &response);
        response["usage"]["server_timing"] = self.seq.split().json();
        if let Some(p) = crate::frontend::api::shared::policy_json(reason) {
            response["policy"] = p;
        }
        let ty = if state == "completed" { "response.completed" } else { "response.incomplete" };
        out.push(self.event(ty, json!({"response": response})));
    }

    fn fail(&mut self, e: ApiError) -> Event {
        let mut response = self.head.object("failed", Value::Null, std::mem::take(&mut self.items), None);
        response["error"] = json!({"code": "server_error", "message": e.to_string()});
        self.event("response.failed", json!({"response": response}))
    }

    pub async fn step(mut self) -> SseStep<Self> {
        if !self.started {
            self.started = true;
            let r = self.head.object("in_progress", Value::Null, vec![], None);
            let created = self.event("response.created", json!({"response": r.clone()}));
            let progress = self.event("response.in_progress", json!({"response": r}));
            return (vec![created, progress], Some(self));
        }
        loop {
            let ev = match self.seq.next(None).await {
                Next::Event(ev) => ev,
                Next::Idle => continue,
                Next::ShutDown => return (vec![self.fail(shut_down())], None),
                Next::Lost => return (vec![self.fail(failed(None))], None),
            };
            let mut out = Vec::new();
            match ev {
                SeqEvent::Started { .. } | SeqEvent::PromptLogprobs { .. } => continue,
                SeqEvent::Delta { text, logprobs, .. } => {
                    if let Some(namer) = &self.namer {
                        self.pending.extend(chat_content(namer, &logprobs));
                    }
                    let pieces = match &mut self.parser {
                        Some(p) => p.push(&text),
                        None => vec![Piece::Text(text)],
                    };
                    self.pieces(pieces, &mut out);
                }
                SeqEvent::Finished { reason: StopReason::Error(e), .. } => return (vec![self.fail(failed(Some(&e)))], None),
                SeqEvent::Finished { reason, usage } => {
                    self.finish(&reason, &usage, &mut out);
                    return (out, None);
                }
            }
            if !out.is_empty() {
                return (out, Some(self));
            }
        }
    }
}
