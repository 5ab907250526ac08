//! The client side of the fixed newstyle handshake, as a state machine without I/O.
//!
//! It haggles the way libnbd does: extended headers if wanted (falling back to structured
//! replies), `base:allocation`, then `NBD_OPT_GO` with block sizes, name and description
//! (falling back to `NBD_OPT_EXPORT_NAME` for servers that do not know GO), or
//! `NBD_OPT_LIST` to list exports. (proto.md "Fixed newstyle negotiation", "Option types")

use crate::consts::*;
use crate::export::BlockSize;
use crate::handshake::encode_option;
use crate::options::{encode_info_request, encode_meta_request};
use crate::reply::ReplyMode;
use crate::request::{be16, be32, be64};

/// What the client wants from the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    pub export: String,
    /// Ask for extended headers (then structured replies if refused).
    pub extended: bool,
    /// Ask for structured replies.
    pub structured: bool,
    /// Ask for the metadata contexts in `contexts` (with structured replies only).
    pub meta_context: bool,
    /// The metadata contexts to select with `NBD_OPT_SET_META_CONTEXT`, by exact name
    /// (default: `base:allocation`). At most [`MAX_CONTEXTS`].
    pub contexts: Vec<String>,
    /// List exports instead of connecting to one.
    pub list: bool,
    /// List the export's metadata contexts (`NBD_OPT_LIST_META_CONTEXT` with no query:
    /// all of them) instead of connecting.
    pub list_contexts: bool,
    /// Upgrade to TLS with `NBD_OPT_STARTTLS` before anything else.
    pub tls: bool,
}

impl ClientConfig {
    pub fn new(export: &str) -> Self {
        ClientConfig {
            export: export.to_string(),
            extended: true,
            structured: true,
            meta_context: true,
            contexts: vec![META_BASE_ALLOCATION.to_string()],
            list: false,
            list_contexts: false,
            tls: false,
        }
    }
}

/// Most metadata contexts a client asks for at once (each answer is one option reply,
/// and [`MAX_OPTION_REPLIES`] bounds those).
pub const MAX_CONTEXTS: usize = 32;

/// What the handshake settled on.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ClientNegotiated {
    pub size: u64,
    pub flags: u16,
    pub mode: Option<ReplyMode>,
    /// The id of `base:allocation`, when the server granted it.
    pub meta_context: Option<u32>,
    /// Every context the server granted: (id, name), in the order it answered. Only
    /// names the client asked for; ids unique.
    pub contexts: Vec<(u32, String)>,
    pub block_size: Option<BlockSize>,
    pub name: Option<String>,
    pub description: Option<String>,
    /// The server answered GO (not only EXPORT_NAME).
    pub used_go: bool,
}

impl ClientNegotiated {
    pub fn reply_mode(&self) -> ReplyMode {
        self.mode.unwrap_or(ReplyMode::Simple)
    }

    /// The name of a granted context id.
    pub fn context_name(&self, id: u32) -> Option<&str> {
        self.contexts.iter().find(|c| c.0 == id).map(|c| c.1.as_str())
    }

    /// The id of a granted context, by name.
    pub fn context_id(&self, name: &str) -> Option<u32> {
        self.contexts.iter().find(|c| c.1 == name).map(|c| c.0)
    }
}

/// Why the handshake failed, in words for the user.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("the peer is not an NBD server (bad greeting)")]
    NotNbd,
    #[error("the server only speaks the oldstyle handshake, which ferry does not support")]
    Oldstyle,
    #[error("the server does not support fixed newstyle negotiation")]
    NotFixedNewstyle,
    #[error("the server refused export {export:?}: {reason}")]
    Refused { export: String, reason: String },
    #[error("the server sent a malformed reply to {0}")]
    Malformed(&'static str),
    #[error("the server sent an option reply of {0} bytes, more than any reply should be")]
    ReplyTooLong(u32),
    #[error("the server sent more than {limit} {what}; ferry stops there (a broken or hostile server)")]
    TooManyReplies { what: &'static str, limit: usize },
    #[error("the server sent {what} of {len} bytes, over the protocol's limit of {MAX_STRING} bytes")]
    StringTooLong { what: &'static str, len: usize },
    #[error("the server requires TLS: connect with an nbds:// or nbds+unix:// URI")]
    TlsRequired,
    #[error("TLS was asked for, but the server refused NBD_OPT_STARTTLS: {0}")]
    TlsRefused(String),
    #[error("the handshake is over")]
    Finished,
}

/// What the caller should do after `feed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientProgress {
    /// Send `out` and feed more bytes.
    Continue,
    /// Send `out`, then start the transmission phase.
    Connected(Box<ClientNegotiated>),
    /// Exports listed (`out` holds NBD_OPT_ABORT): send it and close.
    Listed(Vec<(String, String)>),
    /// The export's metadata contexts listed (`out` holds NBD_OPT_ABORT): send it and close.
    ContextsListed(Vec<String>),
    /// The server accepted `NBD_OPT_STARTTLS`: run the TLS handshake as the client,
    /// then call [`ClientHandshake::tls_started`] and go on over TLS. Bytes the server
    /// sent in plaintext after its ACK must not be trusted: drop the connection.
    StartTls,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Greeting,
    /// Waiting for replies to this option.
    Reply(u32),
    ExportNameReply,
    /// STARTTLS accepted; waiting for the caller to finish the TLS handshake.
    Tls,
    Done,
}

/// Largest option reply accepted (names and descriptions are at most 4 KiB).
const MAX_REPLY: u32 = 64 * 1024;

/// Most exports `NBD_OPT_LIST` takes: each holds up to two 4 KiB strings, so a listing
/// stays under 80 MiB however the server pads it (nbdinfo keeps every one too).
pub const MAX_LIST_EXPORTS: usize = 10_000;

/// Most replies taken to any other option before its final one: `NBD_OPT_GO` answers
/// with one `NBD_REP_INFO` per information type (four are defined), `SET_META_CONTEXT`
/// with one reply per context matched (ferry asks for one).
pub const MAX_OPTION_REPLIES: usize = 64;

pub struct ClientHandshake {
    cfg: ClientConfig,
    state: State,
    no_zeroes: bool,
    n: ClientNegotiated,
    list: Vec<(String, String)>,
    /// Replies taken so far to the option in flight.
    replies: usize,
}

fn reply_name(reply: u32) -> String {
    match reply {
        REP_ERR_UNSUP => "unsupported".into(),
        REP_ERR_POLICY => "forbidden by server policy".into(),
        REP_ERR_INVALID => "invalid request".into(),
        REP_ERR_PLATFORM => "not supported on the server's platform".into(),
        REP_ERR_TLS_REQD => "TLS is required".into(),
        REP_ERR_UNKNOWN => "no such export".into(),
        REP_ERR_SHUTDOWN => "server is shutting down".into(),
        REP_ERR_BLOCK_SIZE_REQD => "block size negotiation required".into(),
        REP_ERR_TOO_BIG => "request too big".into(),
        REP_ERR_EXT_HEADER_REQD => "extended headers required".into(),
        other => format!("error 0x{other:08x}"),
    }
}

/// A string the server sent: at most [`MAX_STRING`] bytes (checked before anything is
/// copied), invalid UTF-8 replaced.
fn string(what: &'static str, b: &[u8]) -> Result<String, ClientError> {
    if b.len() > MAX_STRING {
        return Err(ClientError::StringTooLong { what, len: b.len() });
    }
    Ok(String::from_utf8_lossy(b).into_owned())
}

/// Server text for a message: invalid UTF-8 replaced, control characters escaped (a
/// server's words must not drive the user's terminal).
pub fn printable(b: &[u8]) -> String {
    let mut s = String::new();
    for c in String::from_utf8_lossy(b).chars() {
        if c.is_control() {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    s
}

impl ClientHandshake {
    pub fn new(cfg: ClientConfig) -> Self {
        ClientHandshake {
            cfg,
            state: State::Greeting,
            no_zeroes: false,
            n: ClientNegotiated::default(),
            list: Vec::new(),
            replies: 0,
        }
    }

    /// Consumes at most one server message from `input`, appending what to send to `out`.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) -> Result<(usize, ClientProgress), ClientError> {
        match self.state {
            State::Done => Err(ClientError::Finished),
            State::Tls => Err(ClientError::Malformed("NBD_OPT_STARTTLS (data before the TLS handshake)")),
            State::Greeting => {
                if input.len() < 16 {
                    return Ok((0, ClientProgress::Continue));
                }
                if be64(&input[..8]) != NBDMAGIC {
                    return Err(ClientError::NotNbd);
                }
                if be64(&input[8..16]) != IHAVEOPT {
                    return Err(ClientError::Oldstyle);
                }
                if input.len() < 18 {
                    return Ok((0, ClientProgress::Continue));
                }
                let flags = be16(&input[16..18]);
                if flags & FLAG_FIXED_NEWSTYLE == 0 {
                    return Err(ClientError::NotFixedNewstyle);
                }
                self.no_zeroes = flags & FLAG_NO_ZEROES != 0;
                let mut cflags = FLAG_C_FIXED_NEWSTYLE;
                if self.no_zeroes {
                    cflags |= FLAG_C_NO_ZEROES;
                }
                out.extend_from_slice(&cflags.to_be_bytes());
                if self.cfg.tls {
                    self.send(OPT_STARTTLS, &[], out);
                } else {
                    self.first_option(out);
                }
                Ok((18, ClientProgress::Continue))
            }
            State::ExportNameReply => {
                let need = if self.no_zeroes { 10 } else { 134 };
                if input.len() < need {
                    return Ok((0, ClientProgress::Continue));
                }
                self.n.size = be64(&input[..8]);
                self.n.flags = be16(&input[8..10]);
                self.state = State::Done;
                Ok((need, ClientProgress::Connected(Box::new(self.n.clone()))))
            }
            State::Reply(opt) => {
                if input.len() < 20 {
                    return Ok((0, ClientProgress::Continue));
                }
                if be64(&input[..8]) != REPLY_MAGIC || be32(&input[8..12]) != opt {
                    return Err(ClientError::Malformed(option_name(opt)));
                }
                let reply = be32(&input[12..16]);
                let len = be32(&input[16..20]);
                if len > MAX_REPLY {
                    return Err(ClientError::ReplyTooLong(len));
                }
                let total = 20 + len as usize;
                if input.len() < total {
                    return Ok((0, ClientProgress::Continue));
                }
                let progress = self.reply(opt, reply, &input[20..total], out)?;
                Ok((total, progress))
            }
        }
    }

    /// Call after the TLS handshake that followed [`ClientProgress::StartTls`]; appends
    /// the first option to send over TLS.
    pub fn tls_started(&mut self, out: &mut Vec<u8>) {
        self.first_option(out);
    }

    fn first_option(&mut self, out: &mut Vec<u8>) {
        if self.cfg.list {
            self.send(OPT_LIST, &[], out);
        } else if self.cfg.extended {
            self.send(OPT_EXTENDED_HEADERS, &[], out);
        } else {
            self.after_extended(out);
        }
    }

    fn send(&mut self, opt: u32, data: &[u8], out: &mut Vec<u8>) {
        encode_option(opt, data, out);
        self.state = State::Reply(opt);
        self.replies = 0;
    }

    fn after_extended(&mut self, out: &mut Vec<u8>) {
        if self.n.mode.is_none() && self.cfg.structured {
            self.send(OPT_STRUCTURED_REPLY, &[], out);
        } else {
            self.after_structured(out);
        }
    }

    fn after_structured(&mut self, out: &mut Vec<u8>) {
        if self.cfg.list_contexts {
            let mut d = Vec::new();
            encode_meta_request(&self.cfg.export, &[], &mut d);
            self.send(OPT_LIST_META_CONTEXT, &d, out);
        } else if self.cfg.meta_context && self.n.mode.is_some() && !self.cfg.contexts.is_empty() {
            let mut d = Vec::new();
            let names: Vec<&str> = self.cfg.contexts.iter().take(MAX_CONTEXTS).map(String::as_str).collect();
            encode_meta_request(&self.cfg.export, &names, &mut d);
            self.send(OPT_SET_META_CONTEXT, &d, out);
        } else {
            self.go(out);
        }
    }

    fn go(&mut self, out: &mut Vec<u8>) {
        let mut d = Vec::new();
        encode_info_request(&self.cfg.export, &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION], &mut d);
        self.send(OPT_GO, &d, out);
    }

    fn reply(&mut self, opt: u32, reply: u32, data: &[u8], out: &mut Vec<u8>) -> Result<ClientProgress, ClientError> {
        let error_text = || {
            let msg = printable(&data[..data.len().min(MAX_STRING)]);
            if msg.is_empty() {
                reply_name(reply)
            } else {
                format!("{} ({msg})", reply_name(reply))
            }
        };
        // Replies that are not the option's last one; a server could send them forever.
        self.replies += 1;
        let limit = if matches!(opt, OPT_LIST | OPT_LIST_META_CONTEXT) { MAX_LIST_EXPORTS } else { MAX_OPTION_REPLIES };
        if self.replies > limit && matches!(reply, REP_SERVER | REP_INFO | REP_META_CONTEXT) {
            let what = match opt {
                OPT_LIST => "exports in its list",
                OPT_LIST_META_CONTEXT => "metadata contexts in its list",
                OPT_GO => "NBD_REP_INFO replies to NBD_OPT_GO",
                _ => "replies to one option",
            };
            return Err(ClientError::TooManyReplies { what, limit });
        }
        if reply == REP_ERR_TLS_REQD {
            return Err(ClientError::TlsRequired);
        }
        match opt {
            OPT_STARTTLS => {
                if reply != REP_ACK {
                    return Err(ClientError::TlsRefused(error_text()));
                }
                self.state = State::Tls;
                return Ok(ClientProgress::StartTls);
            }
            OPT_EXTENDED_HEADERS => {
                if reply == REP_ACK {
                    self.n.mode = Some(ReplyMode::Extended);
                }
                self.after_extended(out);
            }
            OPT_STRUCTURED_REPLY => {
                if reply == REP_ACK {
                    self.n.mode = Some(ReplyMode::Structured);
                }
                self.after_structured(out);
            }
            OPT_SET_META_CONTEXT => match reply {
                REP_META_CONTEXT => {
                    if data.len() < 4 {
                        return Err(ClientError::Malformed("NBD_OPT_SET_META_CONTEXT"));
                    }
                    let id = be32(&data[..4]);
                    let name = &data[4..];
                    // Only names asked for count; a name or id granted twice is the
                    // server's mistake (block status could not be told apart).
                    if let Some(n) = self.cfg.contexts.iter().take(MAX_CONTEXTS).find(|c| c.as_bytes() == name) {
                        if self.n.contexts.iter().any(|c| c.0 == id || c.1 == *n) {
                            return Err(ClientError::Malformed(
                                "NBD_OPT_SET_META_CONTEXT (a context id or name twice)",
                            ));
                        }
                        self.n.contexts.push((id, n.clone()));
                        if n == META_BASE_ALLOCATION {
                            self.n.meta_context = Some(id);
                        }
                    }
                }
                REP_ACK => self.go(out),
                // A server without meta contexts: carry on without block status.
                _ => {
                    self.n.meta_context = None;
                    self.n.contexts.clear();
                    self.go(out);
                }
            },
            OPT_GO => match reply {
                REP_INFO => self.info(data)?,
                REP_ACK => {
                    if self.n.flags & FLAG_HAS_FLAGS == 0 {
                        return Err(ClientError::Malformed("NBD_OPT_GO (no NBD_INFO_EXPORT)"));
                    }
                    self.n.used_go = true;
                    self.state = State::Done;
                    return Ok(ClientProgress::Connected(Box::new(self.n.clone())));
                }
                REP_ERR_UNSUP if self.n.mode != Some(ReplyMode::Extended) => {
                    // An old server: EXPORT_NAME can still reach the export.
                    encode_option(OPT_EXPORT_NAME, self.cfg.export.as_bytes(), out);
                    self.n.meta_context = None;
                    self.n.contexts.clear();
                    self.state = State::ExportNameReply;
                }
                _ => return Err(ClientError::Refused { export: self.cfg.export.clone(), reason: error_text() }),
            },
            OPT_LIST_META_CONTEXT => match reply {
                REP_META_CONTEXT => {
                    if data.len() < 4 {
                        return Err(ClientError::Malformed("NBD_OPT_LIST_META_CONTEXT"));
                    }
                    let name = string("a metadata context name", &data[4..])?;
                    self.list.push((name, String::new()));
                }
                REP_ACK => {
                    encode_option(OPT_ABORT, &[], out);
                    self.state = State::Done;
                    let names = std::mem::take(&mut self.list).into_iter().map(|(n, _)| n).collect();
                    return Ok(ClientProgress::ContextsListed(names));
                }
                _ => {
                    return Err(ClientError::Refused {
                        export: self.cfg.export.clone(),
                        reason: format!("listing metadata contexts: {}", error_text()),
                    })
                }
            },
            OPT_LIST => match reply {
                REP_SERVER => {
                    if data.len() < 4 || be32(&data[..4]) as usize > data.len() - 4 {
                        return Err(ClientError::Malformed("NBD_OPT_LIST"));
                    }
                    let nlen = be32(&data[..4]) as usize;
                    let name = string("an export name in its list", &data[4..4 + nlen])?;
                    let desc = string("an export description in its list", &data[4 + nlen..])?;
                    self.list.push((name, desc));
                }
                REP_ACK => {
                    encode_option(OPT_ABORT, &[], out);
                    self.state = State::Done;
                    return Ok(ClientProgress::Listed(std::mem::take(&mut self.list)));
                }
                _ => {
                    return Err(ClientError::Refused {
                        export: String::new(),
                        reason: format!("listing exports: {}", error_text()),
                    })
                }
            },
            _ => return Err(ClientError::Malformed(option_name(opt))),
        }
        Ok(ClientProgress::Continue)
    }

    fn info(&mut self, d: &[u8]) -> Result<(), ClientError> {
        if d.len() < 2 {
            return Err(ClientError::Malformed("NBD_REP_INFO"));
        }
        match be16(&d[..2]) {
            INFO_EXPORT if d.len() == 12 => {
                self.n.size = be64(&d[2..10]);
                self.n.flags = be16(&d[10..12]);
            }
            INFO_EXPORT => return Err(ClientError::Malformed("NBD_INFO_EXPORT")),
            INFO_BLOCK_SIZE if d.len() == 14 => {
                self.n.block_size =
                    Some(BlockSize { minimum: be32(&d[2..6]), preferred: be32(&d[6..10]), maximum: be32(&d[10..14]) });
            }
            INFO_NAME => self.n.name = Some(string("an export name (NBD_INFO_NAME)", &d[2..])?),
            INFO_DESCRIPTION => {
                self.n.description = Some(string("an export description (NBD_INFO_DESCRIPTION)", &d[2..])?)
            }
            _ => {} // unknown information: ignored, as the spec says
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{Capabilities, ExportInfo};
    use crate::handshake::{Catalog, Progress, ServerHandshake, TlsPolicy};

    struct Cat;
    impl Catalog for Cat {
        fn export(&self, name: &str) -> Option<ExportInfo> {
            (name.is_empty() || name == "d").then(|| ExportInfo {
                name: name.into(),
                description: "desc".into(),
                size: 12345,
                caps: Capabilities { flush: true, extents: true, ..Default::default() },
                block_size: BlockSize::default(),
            })
        }
        fn list(&self) -> Vec<(String, String)> {
            vec![("".into(), "desc".into()), ("d".into(), "".into())]
        }
    }

    /// Runs ferry's client against ferry's server, in memory.
    fn talk(cfg: ClientConfig) -> (Result<ClientProgress, ClientError>, Option<Progress>) {
        talk_tls(cfg, TlsPolicy::Off)
    }

    /// As `talk`, with the server's TLS policy; the TLS handshake itself is assumed.
    fn talk_tls(cfg: ClientConfig, policy: TlsPolicy) -> (Result<ClientProgress, ClientError>, Option<Progress>) {
        let mut s2c = Vec::new();
        let mut server = ServerHandshake::with_tls(&mut s2c, policy);
        let mut client = ClientHandshake::new(cfg);
        let mut c2s = Vec::new();
        let mut server_done = None;
        for _ in 0..100 {
            let mut progressed = false;
            loop {
                match client.feed(&s2c, &mut c2s) {
                    Err(e) => return (Err(e), server_done),
                    Ok((0, _)) => break,
                    Ok((n, ClientProgress::StartTls)) => {
                        s2c.drain(..n);
                        progressed = true;
                        client.tls_started(&mut c2s);
                    }
                    Ok((n, p)) => {
                        s2c.drain(..n);
                        progressed = true;
                        if p != ClientProgress::Continue {
                            // let the server see the final bytes too
                            let _ = server.feed(&c2s, &Cat, &mut Vec::new());
                            return (Ok(p), server_done);
                        }
                    }
                }
            }
            loop {
                match server.feed(&c2s, &Cat, &mut s2c) {
                    Ok((0, _)) => break,
                    Ok((n, Progress::StartTls)) => {
                        c2s.drain(..n);
                        progressed = true;
                        server.tls_started();
                    }
                    Ok((n, p)) => {
                        c2s.drain(..n);
                        progressed = true;
                        if p != Progress::Continue {
                            server_done = Some(p);
                        }
                    }
                    Err(_) => break,
                }
            }
            if !progressed {
                break;
            }
        }
        panic!("handshake stalled")
    }

    #[test]
    fn connects_with_extended_headers_and_meta() {
        let (p, _) = talk(ClientConfig::new("d"));
        let Ok(ClientProgress::Connected(n)) = p else { panic!("{p:?}") };
        assert_eq!(n.size, 12345);
        assert_eq!(n.mode, Some(ReplyMode::Extended));
        assert!(n.meta_context.is_some());
        assert_eq!(n.description.as_deref(), Some("desc"));
        assert!(n.used_go);
    }

    #[test]
    fn structured_only_and_plain() {
        let mut c = ClientConfig::new("");
        c.extended = false;
        let (p, _) = talk(c.clone());
        let Ok(ClientProgress::Connected(n)) = p else { panic!() };
        assert_eq!(n.mode, Some(ReplyMode::Structured));
        c.structured = false;
        let (p, _) = talk(c);
        let Ok(ClientProgress::Connected(n)) = p else { panic!() };
        assert_eq!(n.mode, None);
        assert_eq!(n.meta_context, None);
    }

    #[test]
    fn lists_and_refuses() {
        let mut c = ClientConfig::new("");
        c.list = true;
        let (p, _) = talk(c);
        assert_eq!(p, Ok(ClientProgress::Listed(vec![("".into(), "desc".into()), ("d".into(), "".into())])));
        let (p, _) = talk(ClientConfig::new("nope"));
        let Err(ClientError::Refused { reason, .. }) = p else { panic!("{p:?}") };
        assert!(reason.contains("no such export"), "{reason}");
    }

    #[test]
    fn starttls_first_and_clear_errors() {
        let mut c = ClientConfig::new("d");
        c.tls = true;
        let (p, s) = talk_tls(c.clone(), TlsPolicy::Require);
        let Ok(ClientProgress::Connected(n)) = p else { panic!("{p:?}") };
        assert_eq!(n.mode, Some(ReplyMode::Extended));
        assert!(matches!(s, Some(Progress::Transmission(_))));
        let (p, _) = talk_tls(c, TlsPolicy::Off);
        let Err(ClientError::TlsRefused(why)) = p else { panic!("{p:?}") };
        assert!(why.contains("not enabled"), "{why}");
        let (p, _) = talk_tls(ClientConfig::new("d"), TlsPolicy::Require);
        assert_eq!(p, Err(ClientError::TlsRequired));
        let (p, _) = talk_tls(ClientConfig::new("d"), TlsPolicy::On);
        assert!(matches!(p, Ok(ClientProgress::Connected(_))), "{p:?}");
    }

    #[test]
    fn bytes_after_the_starttls_ack_are_refused() {
        let mut cfg = ClientConfig::new("d");
        cfg.tls = true;
        let mut h = ClientHandshake::new(cfg);
        let mut out = Vec::new();
        let mut s2c = Vec::new();
        ServerHandshake::new(&mut s2c);
        let (n, _) = h.feed(&s2c, &mut out).unwrap();
        assert_eq!(n, 18);
        // The ACK, then plaintext a man in the middle could have added.
        let mut ack = Vec::new();
        crate::handshake::option_reply(&mut ack, OPT_STARTTLS, REP_ACK, &[]);
        let injected = ack.len();
        ack.extend_from_slice(b"injected");
        let (n, p) = h.feed(&ack, &mut out).unwrap();
        assert_eq!((n, p), (injected, ClientProgress::StartTls), "only the ACK is consumed");
        assert!(matches!(h.feed(&ack[n..], &mut out), Err(ClientError::Malformed(_))));
    }

    /// A client listing exports, past the greeting.
    fn listing() -> ClientHandshake {
        let mut cfg = ClientConfig::new("");
        cfg.list = true;
        let mut h = ClientHandshake::new(cfg);
        let mut s2c = Vec::new();
        ServerHandshake::new(&mut s2c);
        assert_eq!(h.feed(&s2c, &mut Vec::new()).unwrap().0, 18);
        h
    }

    fn server_reply(name: &[u8], desc: &[u8]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d.extend_from_slice(desc);
        let mut r = Vec::new();
        crate::handshake::option_reply(&mut r, OPT_LIST, REP_SERVER, &d);
        r
    }

    #[test]
    fn export_lists_and_strings_are_bounded() {
        let mut h = listing();
        let one = server_reply(b"x", b"");
        for _ in 0..MAX_LIST_EXPORTS {
            assert_eq!(h.feed(&one, &mut Vec::new()), Ok((one.len(), ClientProgress::Continue)));
        }
        let e = h.feed(&one, &mut Vec::new()).unwrap_err();
        assert_eq!(e, ClientError::TooManyReplies { what: "exports in its list", limit: MAX_LIST_EXPORTS });
        assert!(e.to_string().contains("more than 10000 exports"), "{e}");
        for (name, desc) in [(vec![b'n'; MAX_STRING + 1], vec![]), (vec![], vec![b'd'; MAX_STRING + 1])] {
            let e = listing().feed(&server_reply(&name, &desc), &mut Vec::new()).unwrap_err();
            assert!(matches!(e, ClientError::StringTooLong { len: 4097, .. }), "{e:?}");
        }
        let ok = server_reply(&[b'n'; MAX_STRING], &[b'd'; MAX_STRING]);
        assert!(listing().feed(&ok, &mut Vec::new()).is_ok());
    }

    /// A client asking for `contexts`, past the greeting and the option negotiation up
    /// to SET_META_CONTEXT (structured replies accepted).
    fn setting(contexts: &[&str]) -> ClientHandshake {
        let mut cfg = ClientConfig::new("d");
        cfg.extended = false;
        cfg.contexts = contexts.iter().map(|c| c.to_string()).collect();
        let mut h = ClientHandshake::new(cfg);
        let mut s2c = Vec::new();
        ServerHandshake::new(&mut s2c);
        assert_eq!(h.feed(&s2c, &mut Vec::new()).unwrap().0, 18);
        let mut ack = Vec::new();
        crate::handshake::option_reply(&mut ack, OPT_STRUCTURED_REPLY, REP_ACK, &[]);
        let mut out = Vec::new();
        assert_eq!(h.feed(&ack, &mut out).unwrap().0, ack.len());
        assert_eq!(be32(&out[8..12]), OPT_SET_META_CONTEXT);
        h
    }

    fn meta_reply(opt: u32, id: u32, name: &str) -> Vec<u8> {
        let mut d = id.to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        let mut r = Vec::new();
        crate::handshake::option_reply(&mut r, opt, REP_META_CONTEXT, &d);
        r
    }

    #[test]
    fn several_contexts_are_recorded_by_id() {
        let mut h = setting(&["base:allocation", "qemu:dirty-bitmap:b0", "qemu:allocation-depth"]);
        let mut out = Vec::new();
        for (id, name) in [(7, "qemu:dirty-bitmap:b0"), (3, "base:allocation"), (9, "not:asked")] {
            assert!(h.feed(&meta_reply(OPT_SET_META_CONTEXT, id, name), &mut out).is_ok());
        }
        let mut ack = Vec::new();
        crate::handshake::option_reply(&mut ack, OPT_SET_META_CONTEXT, REP_ACK, &[]);
        h.feed(&ack, &mut out).unwrap();
        assert_eq!(h.n.contexts, vec![(7, "qemu:dirty-bitmap:b0".to_string()), (3, "base:allocation".to_string())]);
        assert_eq!(h.n.meta_context, Some(3));
        assert_eq!(h.n.context_name(7), Some("qemu:dirty-bitmap:b0"));
        assert_eq!(h.n.context_id("qemu:allocation-depth"), None);
        // One id for two contexts, or one context twice: refused.
        for second in [(7, "base:allocation"), (8, "qemu:dirty-bitmap:b0")] {
            let mut h = setting(&["base:allocation", "qemu:dirty-bitmap:b0"]);
            h.feed(&meta_reply(OPT_SET_META_CONTEXT, 7, "qemu:dirty-bitmap:b0"), &mut out).unwrap();
            let e = h.feed(&meta_reply(OPT_SET_META_CONTEXT, second.0, second.1), &mut out).unwrap_err();
            assert!(matches!(e, ClientError::Malformed(_)), "{e:?}");
        }
        // Truncated reply.
        let mut r = Vec::new();
        crate::handshake::option_reply(&mut r, OPT_SET_META_CONTEXT, REP_META_CONTEXT, &[0, 0]);
        assert!(setting(&["base:allocation"]).feed(&r, &mut out).is_err());
    }

    #[test]
    fn contexts_are_listed() {
        let mut cfg = ClientConfig::new("d");
        cfg.list_contexts = true;
        cfg.extended = false;
        let mut h = ClientHandshake::new(cfg);
        let mut s2c = Vec::new();
        ServerHandshake::new(&mut s2c);
        h.feed(&s2c, &mut Vec::new()).unwrap();
        let mut ack = Vec::new();
        crate::handshake::option_reply(&mut ack, OPT_STRUCTURED_REPLY, REP_ACK, &[]);
        let mut out = Vec::new();
        h.feed(&ack, &mut out).unwrap();
        assert_eq!(be32(&out[8..12]), OPT_LIST_META_CONTEXT);
        for (id, n) in [(1, "base:allocation"), (2, "qemu:dirty-bitmap:b1")] {
            h.feed(&meta_reply(OPT_LIST_META_CONTEXT, id, n), &mut out).unwrap();
        }
        let mut ack = Vec::new();
        crate::handshake::option_reply(&mut ack, OPT_LIST_META_CONTEXT, REP_ACK, &[]);
        let (_, p) = h.feed(&ack, &mut out).unwrap();
        assert_eq!(p, ClientProgress::ContextsListed(vec!["base:allocation".into(), "qemu:dirty-bitmap:b1".into()]));
    }

    #[test]
    fn rejects_non_nbd_peers() {
        let mut h = ClientHandshake::new(ClientConfig::new(""));
        assert_eq!(h.feed(b"HTTP/1.1 200 OK\r\n\r\n", &mut Vec::new()), Err(ClientError::NotNbd));
    }
}
