//! The server side of the fixed newstyle handshake, as a state machine without I/O.
//!
//! The caller writes [`ServerHandshake::new`]'s greeting, then feeds received bytes to
//! [`ServerHandshake::feed`], sends whatever it appended to `out`, and repeats until
//! it gets [`Progress::Transmission`] (enter transmission phase with the negotiated
//! [`Negotiated`]) or [`Progress::Abort`] (the client ended the session). An `Err`
//! means the connection must be dropped. (proto.md "Newstyle negotiation",
//! "Fixed newstyle negotiation", "Option types", "Option reply types")

use crate::consts::*;
use crate::export::ExportInfo;
use crate::options::{parse_info_request, parse_meta_request, parse_string};
use crate::reply::ReplyMode;
use crate::request::{be32, be64, Session};
use std::collections::HashSet;

/// Where the handshake finds exports.
pub trait Catalog {
    /// The export called `name` (`""` is the default export), if it exists.
    fn export(&self, name: &str) -> Option<ExportInfo>;
    /// Every export's name and description, for `NBD_OPT_LIST`.
    fn list(&self) -> Vec<(String, String)>;
    /// The metadata contexts the export called `name` (its canonical name, as in its
    /// [`ExportInfo`]) offers, in the order the server keeps them: `SET_META_CONTEXT`
    /// records indexes into this list. Default: `base:allocation` alone.
    fn contexts(&self, name: &str) -> Vec<String> {
        let _ = name;
        vec![META_BASE_ALLOCATION.to_string()]
    }
}

/// Why a handshake ended without reaching transmission: drop the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    #[error("client sent unknown client flags 0x{0:08x}")]
    BadClientFlags(u32),
    #[error("bad option magic 0x{0:016x}: client is not speaking NBD newstyle")]
    BadOptionMagic(u64),
    #[error("NBD_OPT_EXPORT_NAME asked for export {0:?}, which does not exist")]
    UnknownExport(String),
    #[error("NBD_OPT_EXPORT_NAME sent with an invalid name: {0}")]
    BadExportName(String),
    #[error("NBD_OPT_EXPORT_NAME used after extended headers were negotiated")]
    ExportNameWithExtendedHeaders,
    #[error("NBD_OPT_EXPORT_NAME data of {0} bytes is too long")]
    ExportNameTooLong(u32),
    #[error("bytes received after the handshake finished")]
    Finished,
    #[error("the client asked for an export in plaintext, but this server requires TLS")]
    TlsRequired,
}

/// Whether the server offers or insists on TLS (nbdkit's `--tls=off|on|require`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TlsPolicy {
    /// `NBD_OPT_STARTTLS` is refused.
    #[default]
    Off,
    /// STARTTLS is offered; plaintext clients may still use every export.
    On,
    /// Nothing but STARTTLS and ABORT is answered before the upgrade, so not even the
    /// export list leaks (`NBD_REP_ERR_TLS_REQD`).
    Require,
}

/// What the caller should do after a call to `feed`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// Send `out` (if not empty) and feed more bytes.
    Continue,
    /// The client sent `NBD_OPT_ABORT`: send `out`, then close.
    Abort,
    /// Send `out`, then enter the transmission phase.
    Transmission(Box<Negotiated>),
    /// Send `out` (the ACK of `NBD_OPT_STARTTLS`), run the TLS handshake as the server,
    /// call [`ServerHandshake::tls_started`] and go on feeding bytes read through TLS.
    /// Any plaintext bytes already received after the STARTTLS option must be
    /// discarded with the connection: they were sent before the upgrade and could have
    /// been injected by anyone on the path.
    StartTls,
}

/// Everything the transmission phase needs from the handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    pub export: ExportInfo,
    pub mode: ReplyMode,
    /// Transmission flags sent to the client.
    pub flags: u16,
    /// The metadata contexts the client selected for this export: (context id, index
    /// in [`Catalog::contexts`]), in that list's order. Empty without chunked replies.
    pub meta_contexts: Vec<(u32, usize)>,
}

impl Negotiated {
    pub fn session(&self) -> Session {
        Session {
            size: self.export.size,
            flags: self.flags,
            extended: self.mode == ReplyMode::Extended,
            chunked: self.mode != ReplyMode::Simple,
            meta_contexts: self.meta_contexts.clone(),
            min_block: self.export.block_size.minimum,
            max_payload: self.export.block_size.maximum,
        }
    }
}

/// The id ferry gives the first context a connection selects; each context selected
/// after it, by the same or a later `SET_META_CONTEXT`, gets the next one, so no id is
/// ever reused on a connection.
pub const FIRST_CONTEXT_ID: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    ClientFlags,
    Options,
    /// Discarding the data of an oversized option, then answering `NBD_REP_ERR_TOO_BIG`
    /// (or `NBD_REP_ERR_TLS_REQD`, when TLS is required and not yet started).
    Skipping {
        opt: u32,
        remaining: u64,
        tls_required: bool,
    },
    Done,
}

/// Server handshake state.
#[derive(Debug, Clone)]
pub struct ServerHandshake {
    state: State,
    no_zeroes: bool,
    structured: bool,
    extended: bool,
    /// What the last SET_META_CONTEXT selected: the export (canonical name) and its
    /// contexts as (id, index in [`Catalog::contexts`]).
    meta: Option<(String, Vec<(u32, usize)>)>,
    /// The id the next selected context gets.
    next_id: u32,
    tls: TlsPolicy,
    /// The TLS handshake has completed.
    tls_active: bool,
}

/// Handshake flags ferry advertises.
pub const SERVER_FLAGS: u16 = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;

impl ServerHandshake {
    /// Starts a handshake without TLS and appends the server greeting to `out`.
    pub fn new(out: &mut Vec<u8>) -> Self {
        Self::with_tls(out, TlsPolicy::Off)
    }

    /// Starts a handshake with a TLS policy and appends the server greeting to `out`.
    pub fn with_tls(out: &mut Vec<u8>, tls: TlsPolicy) -> Self {
        out.extend_from_slice(&NBDMAGIC.to_be_bytes());
        out.extend_from_slice(&IHAVEOPT.to_be_bytes());
        out.extend_from_slice(&SERVER_FLAGS.to_be_bytes());
        ServerHandshake {
            state: State::ClientFlags,
            no_zeroes: false,
            structured: false,
            extended: false,
            meta: None,
            next_id: FIRST_CONTEXT_ID,
            tls,
            tls_active: false,
        }
    }

    /// Records that the TLS handshake after `NBD_OPT_STARTTLS` succeeded. What was
    /// negotiated in plaintext is forgotten (proto.md: state from before the upgrade
    /// must not carry over).
    pub fn tls_started(&mut self) {
        self.tls_active = true;
        self.structured = false;
        self.extended = false;
        self.meta = None;
    }

    /// Whether the session runs over TLS.
    pub fn tls_active(&self) -> bool {
        self.tls_active
    }

    /// Consumes at most one client message from the front of `input`, appending any reply
    /// to `out`. Returns the number of bytes consumed (0: need more bytes).
    pub fn feed(
        &mut self,
        input: &[u8],
        catalog: &dyn Catalog,
        out: &mut Vec<u8>,
    ) -> Result<(usize, Progress), HandshakeError> {
        match self.state {
            State::Done => Err(HandshakeError::Finished),
            State::ClientFlags => {
                if input.len() < 4 {
                    return Ok((0, Progress::Continue));
                }
                let flags = be32(&input[..4]);
                if flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
                    return Err(HandshakeError::BadClientFlags(flags));
                }
                self.no_zeroes = flags & FLAG_C_NO_ZEROES != 0;
                self.state = State::Options;
                Ok((4, Progress::Continue))
            }
            State::Skipping { opt, remaining, tls_required } => {
                let n = (input.len() as u64).min(remaining);
                let remaining = remaining - n;
                if remaining == 0 {
                    self.state = State::Options;
                    if tls_required {
                        self.tls_required_reply(opt, out);
                    } else {
                        let msg = format!("option data is larger than the {MAX_OPTION_DATA}-byte limit");
                        option_reply(out, opt, REP_ERR_TOO_BIG, msg.as_bytes());
                    }
                } else {
                    self.state = State::Skipping { opt, remaining, tls_required };
                }
                Ok((n as usize, Progress::Continue))
            }
            State::Options => {
                if input.len() < OPTION_HEADER_LEN {
                    return Ok((0, Progress::Continue));
                }
                let magic = be64(&input[0..8]);
                if magic != IHAVEOPT {
                    return Err(HandshakeError::BadOptionMagic(magic));
                }
                let opt = be32(&input[8..12]);
                let len = be32(&input[12..16]);
                if len > MAX_OPTION_DATA {
                    let tls_required = self.tls_required_for(opt);
                    if opt == OPT_EXPORT_NAME {
                        // No error reply exists for EXPORT_NAME: the spec says drop.
                        return Err(if tls_required {
                            HandshakeError::TlsRequired
                        } else {
                            HandshakeError::ExportNameTooLong(len)
                        });
                    }
                    // Before STARTTLS under `require`, every option is answered TLS_REQD,
                    // whatever its size: the reply must not depend on anything but TLS.
                    self.state = State::Skipping { opt, remaining: u64::from(len), tls_required };
                    return Ok((OPTION_HEADER_LEN, Progress::Continue));
                }
                let total = OPTION_HEADER_LEN + len as usize;
                if input.len() < total {
                    return Ok((0, Progress::Continue));
                }
                let data = &input[OPTION_HEADER_LEN..total];
                let progress = self.option(opt, data, catalog, out)?;
                Ok((total, progress))
            }
        }
    }

    /// Whether the handshake has finished.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    fn mode(&self) -> ReplyMode {
        if self.extended {
            ReplyMode::Extended
        } else if self.structured {
            ReplyMode::Structured
        } else {
            ReplyMode::Simple
        }
    }

    /// The contexts selected for `export`, if chunked replies make them usable.
    fn selected(&self, export: &ExportInfo) -> &[(u32, usize)] {
        match &self.meta {
            Some((name, sel)) if *name == export.name && self.mode() != ReplyMode::Simple => sel,
            _ => &[],
        }
    }

    /// Transmission flags for `export`: with extended headers and contexts selected,
    /// BLOCK_STATUS may carry a context filter (`NBD_FLAG_BLOCK_STATUS_PAYLOAD`).
    fn flags_for(&self, export: &ExportInfo) -> u16 {
        let mode = self.mode();
        let mut flags = export.transmission_flags(mode != ReplyMode::Simple);
        if mode == ReplyMode::Extended && !self.selected(export).is_empty() {
            flags |= FLAG_BLOCK_STATUS_PAYLOAD;
        }
        flags
    }

    fn negotiated(&mut self, export: ExportInfo) -> Negotiated {
        let mode = self.mode();
        let flags = self.flags_for(&export);
        let meta_contexts = self.selected(&export).to_vec();
        self.state = State::Done;
        Negotiated { export, mode, flags, meta_contexts }
    }

    /// Option `opt` may only be answered `NBD_REP_ERR_TLS_REQD` (under `--tls=require`,
    /// before STARTTLS; ABORT and STARTTLS itself are served).
    fn tls_required_for(&self, opt: u32) -> bool {
        self.tls == TlsPolicy::Require && !self.tls_active && opt != OPT_STARTTLS && opt != OPT_ABORT
    }

    fn tls_required_reply(&self, opt: u32, out: &mut Vec<u8>) {
        let msg = format!("this server requires TLS: send NBD_OPT_STARTTLS before {}", option_name(opt));
        option_reply(out, opt, REP_ERR_TLS_REQD, msg.as_bytes());
    }

    fn option(
        &mut self,
        opt: u32,
        data: &[u8],
        catalog: &dyn Catalog,
        out: &mut Vec<u8>,
    ) -> Result<Progress, HandshakeError> {
        if self.tls_required_for(opt) {
            if opt == OPT_EXPORT_NAME {
                // EXPORT_NAME has no error reply: the only answer is to hang up.
                return Err(HandshakeError::TlsRequired);
            }
            self.tls_required_reply(opt, out);
            return Ok(Progress::Continue);
        }
        match opt {
            OPT_EXPORT_NAME => {
                if self.extended {
                    return Err(HandshakeError::ExportNameWithExtendedHeaders);
                }
                let name = parse_string(data).map_err(|e| HandshakeError::BadExportName(e.to_string()))?;
                let export = catalog.export(&name).ok_or(HandshakeError::UnknownExport(name))?;
                let n = self.negotiated(export);
                out.extend_from_slice(&n.export.size.to_be_bytes());
                out.extend_from_slice(&n.flags.to_be_bytes());
                if !self.no_zeroes {
                    out.extend_from_slice(&[0u8; 124]);
                }
                Ok(Progress::Transmission(Box::new(n)))
            }
            OPT_ABORT => {
                option_reply(out, opt, REP_ACK, &[]);
                self.state = State::Done;
                Ok(Progress::Abort)
            }
            OPT_LIST => {
                if !data.is_empty() {
                    return Ok(invalid(out, opt, "NBD_OPT_LIST takes no data"));
                }
                for (name, desc) in catalog.list() {
                    let mut d = Vec::with_capacity(4 + name.len() + desc.len());
                    d.extend_from_slice(&(name.len() as u32).to_be_bytes());
                    d.extend_from_slice(name.as_bytes());
                    d.extend_from_slice(desc.as_bytes());
                    option_reply(out, opt, REP_SERVER, &d);
                }
                option_reply(out, opt, REP_ACK, &[]);
                Ok(Progress::Continue)
            }
            OPT_STARTTLS => {
                if self.tls == TlsPolicy::Off {
                    option_reply(out, opt, REP_ERR_UNSUP, b"TLS is not enabled on this server (ferry serve --tls=on)");
                    return Ok(Progress::Continue);
                }
                if self.tls_active {
                    return Ok(invalid(out, opt, "TLS is already active"));
                }
                if !data.is_empty() {
                    return Ok(invalid(out, opt, "NBD_OPT_STARTTLS takes no data"));
                }
                option_reply(out, opt, REP_ACK, &[]);
                Ok(Progress::StartTls)
            }
            OPT_INFO | OPT_GO => {
                let req = match parse_info_request(data) {
                    Ok(r) => r,
                    Err(e) => return Ok(invalid(out, opt, &e.to_string())),
                };
                let Some(export) = catalog.export(&req.name) else {
                    let msg = format!("export {:?} does not exist on this server", req.name);
                    option_reply(out, opt, REP_ERR_UNKNOWN, msg.as_bytes());
                    return Ok(Progress::Continue);
                };
                let flags = self.flags_for(&export);
                let mut info = Vec::with_capacity(14);
                info.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                info.extend_from_slice(&export.size.to_be_bytes());
                info.extend_from_slice(&flags.to_be_bytes());
                option_reply(out, opt, REP_INFO, &info);
                if req.requests.contains(&INFO_NAME) {
                    info.clear();
                    info.extend_from_slice(&INFO_NAME.to_be_bytes());
                    info.extend_from_slice(export.name.as_bytes());
                    option_reply(out, opt, REP_INFO, &info);
                }
                if req.requests.contains(&INFO_DESCRIPTION) && !export.description.is_empty() {
                    info.clear();
                    info.extend_from_slice(&INFO_DESCRIPTION.to_be_bytes());
                    info.extend_from_slice(export.description.as_bytes());
                    option_reply(out, opt, REP_INFO, &info);
                }
                // Block sizes are always sent: clients ignore what they did not ask for.
                let bs = export.block_size;
                info.clear();
                info.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                info.extend_from_slice(&bs.minimum.to_be_bytes());
                info.extend_from_slice(&bs.preferred.to_be_bytes());
                info.extend_from_slice(&bs.maximum.to_be_bytes());
                option_reply(out, opt, REP_INFO, &info);
                option_reply(out, opt, REP_ACK, &[]);
                if opt == OPT_GO {
                    let n = self.negotiated(export);
                    return Ok(Progress::Transmission(Box::new(n)));
                }
                Ok(Progress::Continue)
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    return Ok(invalid(out, opt, "NBD_OPT_STRUCTURED_REPLY takes no data"));
                }
                if self.extended {
                    option_reply(out, opt, REP_ERR_EXT_HEADER_REQD, b"extended headers are already negotiated");
                    return Ok(Progress::Continue);
                }
                self.structured = true;
                option_reply(out, opt, REP_ACK, &[]);
                Ok(Progress::Continue)
            }
            OPT_EXTENDED_HEADERS => {
                if !data.is_empty() {
                    return Ok(invalid(out, opt, "NBD_OPT_EXTENDED_HEADERS takes no data"));
                }
                self.extended = true;
                option_reply(out, opt, REP_ACK, &[]);
                Ok(Progress::Continue)
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = opt == OPT_SET_META_CONTEXT;
                if set {
                    // SET replaces earlier selections, even when it fails.
                    self.meta = None;
                }
                if !self.structured && !self.extended {
                    return Ok(invalid(out, opt, "negotiate structured replies or extended headers first"));
                }
                let req = match parse_meta_request(data) {
                    Ok(r) => r,
                    Err(e) => return Ok(invalid(out, opt, &e.to_string())),
                };
                let Some(export) = catalog.export(&req.export) else {
                    let msg = format!("export {:?} does not exist on this server", req.export);
                    option_reply(out, opt, REP_ERR_UNKNOWN, msg.as_bytes());
                    return Ok(Progress::Continue);
                };
                let contexts = catalog.contexts(&export.name);
                // In the export's order, each context once however many queries name it;
                // unknown names select nothing. An exact name always matches; in LIST, a
                // query ending in `:` is a namespace (`base:`, `qemu:`) or, as qemu
                // answers, `qemu:dirty-bitmap:` for every bitmap; LIST without queries
                // lists everything. (proto.md "Metadata querying")
                // Looked up by hash, per `:` of each name: no queries x contexts product.
                let queries: HashSet<&str> = req.queries.iter().map(String::as_str).collect();
                let wanted = |name: &str| {
                    queries.contains(name)
                        || (!set
                            && (queries.is_empty()
                                || name.match_indices(':').any(|(i, _)| queries.contains(&name[..=i]))))
                };
                let chosen: Vec<usize> =
                    contexts.iter().enumerate().filter(|(_, name)| wanted(name)).map(|(i, _)| i).collect();
                if set && u64::from(self.next_id) + chosen.len() as u64 > u64::from(u32::MAX) {
                    return Ok(invalid(out, opt, "no context ids left on this connection"));
                }
                let mut selected = Vec::with_capacity(if set { chosen.len() } else { 0 });
                for i in chosen {
                    let name = &contexts[i];
                    // LIST answers with id 0: ids mean something only once selected.
                    let id = if set { self.next_id } else { 0 };
                    let mut d = Vec::with_capacity(4 + name.len());
                    d.extend_from_slice(&id.to_be_bytes());
                    d.extend_from_slice(name.as_bytes());
                    option_reply(out, opt, REP_META_CONTEXT, &d);
                    if set {
                        selected.push((id, i));
                        self.next_id += 1;
                    }
                }
                if set {
                    // Canonical name, so "" and the default export's name agree.
                    self.meta = Some((export.name, selected));
                }
                option_reply(out, opt, REP_ACK, &[]);
                Ok(Progress::Continue)
            }
            _ => {
                let msg = format!("option {opt} ({}) is not supported by this server", option_name(opt));
                option_reply(out, opt, REP_ERR_UNSUP, msg.as_bytes());
                Ok(Progress::Continue)
            }
        }
    }
}

fn invalid(out: &mut Vec<u8>, opt: u32, msg: &str) -> Progress {
    option_reply(out, opt, REP_ERR_INVALID, msg.as_bytes());
    Progress::Continue
}

/// Appends one fixed-newstyle option reply.
pub fn option_reply(out: &mut Vec<u8>, opt: u32, reply: u32, data: &[u8]) {
    out.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Encodes a client option header and data (for clients, tests and fuzz seeds).
pub fn encode_option(opt: u32, data: &[u8], out: &mut Vec<u8>) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::{BlockSize, Capabilities};
    use crate::options::{encode_info_request, encode_meta_request};

    struct One;
    impl Catalog for One {
        fn export(&self, name: &str) -> Option<ExportInfo> {
            (name.is_empty() || name == "disk").then(|| ExportInfo {
                name: "disk".into(),
                description: "a test disk".into(),
                size: 1 << 20,
                caps: Capabilities { flush: true, trim: true, zero: true, extents: true, ..Default::default() },
                block_size: BlockSize::default(),
            })
        }
        fn list(&self) -> Vec<(String, String)> {
            vec![("disk".into(), "a test disk".into())]
        }
    }

    /// Feeds everything, returning the server's bytes and the final progress.
    fn run(input: &[u8]) -> (Vec<u8>, Result<Progress, HandshakeError>) {
        let mut out = Vec::new();
        let mut hs = ServerHandshake::new(&mut out);
        run_on(&mut hs, input, out)
    }

    fn run_on(hs: &mut ServerHandshake, input: &[u8], mut out: Vec<u8>) -> (Vec<u8>, Result<Progress, HandshakeError>) {
        let mut pos = 0;
        loop {
            match hs.feed(&input[pos..], &One, &mut out) {
                Err(e) => return (out, Err(e)),
                Ok((0, p)) => return (out, Ok(p)),
                Ok((n, p)) => {
                    pos += n;
                    if p != Progress::Continue {
                        return (out, Ok(p));
                    }
                }
            }
        }
    }

    /// Splits server output after the 18-byte greeting into option replies (opt, type, data).
    fn replies(out: &[u8]) -> Vec<(u32, u32, Vec<u8>)> {
        let mut v = Vec::new();
        let mut p = &out[18..];
        while p.len() >= 20 {
            assert_eq!(be64(&p[0..8]), REPLY_MAGIC);
            let len = be32(&p[16..20]) as usize;
            v.push((be32(&p[8..12]), be32(&p[12..16]), p[20..20 + len].to_vec()));
            p = &p[20 + len..];
        }
        v
    }

    fn client_flags() -> Vec<u8> {
        (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes().to_vec()
    }

    #[test]
    fn greeting() {
        let mut out = Vec::new();
        ServerHandshake::new(&mut out);
        assert_eq!(&out[..8], b"NBDMAGIC");
        assert_eq!(&out[8..16], b"IHAVEOPT");
        assert_eq!(out.len(), 18);
    }

    #[test]
    fn go_with_structured_and_meta() {
        let mut i = client_flags();
        encode_option(OPT_STRUCTURED_REPLY, &[], &mut i);
        let mut m = Vec::new();
        encode_meta_request("disk", &[META_BASE_ALLOCATION], &mut m);
        encode_option(OPT_SET_META_CONTEXT, &m, &mut i);
        let mut g = Vec::new();
        encode_info_request("disk", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION], &mut g);
        encode_option(OPT_GO, &g, &mut i);
        let (out, p) = run(&i);
        let Ok(Progress::Transmission(n)) = p else { panic!("{p:?}") };
        assert_eq!(n.mode, ReplyMode::Structured);
        assert_eq!(n.meta_contexts, vec![(FIRST_CONTEXT_ID, 0)]);
        assert_ne!(n.flags & FLAG_SEND_DF, 0);
        assert_eq!(n.flags & FLAG_BLOCK_STATUS_PAYLOAD, 0, "compact headers: no context filter");
        let r = replies(&out);
        assert_eq!(r[0], (OPT_STRUCTURED_REPLY, REP_ACK, vec![]));
        assert_eq!(r[1].1, REP_META_CONTEXT);
        assert_eq!(r[2].1, REP_ACK);
        assert!(r.iter().any(|x| x.1 == REP_INFO && x.2[..2] == INFO_DESCRIPTION.to_be_bytes()));
        assert_eq!(r.last().unwrap().1, REP_ACK);
    }

    #[test]
    fn meta_for_other_export_is_not_kept() {
        let mut i = client_flags();
        encode_option(OPT_EXTENDED_HEADERS, &[], &mut i);
        let mut m = Vec::new();
        encode_meta_request("disk", &[META_BASE_ALLOCATION], &mut m);
        encode_option(OPT_SET_META_CONTEXT, &m, &mut i);
        let mut g = Vec::new();
        encode_info_request("", &[], &mut g);
        encode_option(OPT_GO, &g, &mut i);
        let (_, p) = run(&i);
        let Ok(Progress::Transmission(n)) = p else { panic!() };
        assert_eq!(n.mode, ReplyMode::Extended);
        // the default export is canonically "disk" here, so the selection carries over
        assert_eq!(n.meta_contexts, vec![(FIRST_CONTEXT_ID, 0)]);
        assert_ne!(n.flags & FLAG_BLOCK_STATUS_PAYLOAD, 0);
    }

    /// An export with several contexts, like a qcow2 image with two bitmaps.
    struct Many;
    const MANY: [&str; 4] =
        [META_BASE_ALLOCATION, "qemu:allocation-depth", "qemu:dirty-bitmap:b0", "qemu:dirty-bitmap:b1"];
    impl Catalog for Many {
        fn export(&self, name: &str) -> Option<ExportInfo> {
            One.export(name)
        }
        fn list(&self) -> Vec<(String, String)> {
            One.list()
        }
        fn contexts(&self, name: &str) -> Vec<String> {
            assert_eq!(name, "disk", "contexts are asked by canonical name");
            MANY.iter().map(|s| s.to_string()).collect()
        }
    }

    fn run_many(input: &[u8]) -> (Vec<u8>, Result<Progress, HandshakeError>) {
        let mut out = Vec::new();
        let mut hs = ServerHandshake::new(&mut out);
        let mut pos = 0;
        loop {
            match hs.feed(&input[pos..], &Many, &mut out) {
                Err(e) => return (out, Err(e)),
                Ok((0, p)) => return (out, Ok(p)),
                Ok((n, p)) => {
                    pos += n;
                    if p != Progress::Continue {
                        return (out, Ok(p));
                    }
                }
            }
        }
    }

    /// The (id, name) of each REP_META_CONTEXT of option `opt`, up to its ACK, in order.
    fn contexts_of(r: &[(u32, u32, Vec<u8>)], opt: u32) -> Vec<Vec<(u32, String)>> {
        let mut all = Vec::new();
        let mut cur = Vec::new();
        for (o, ty, d) in r {
            if *o != opt {
                continue;
            }
            match *ty {
                REP_META_CONTEXT => cur.push((be32(&d[..4]), String::from_utf8(d[4..].to_vec()).unwrap())),
                _ => all.push(std::mem::take(&mut cur)),
            }
        }
        all
    }

    fn meta(opt: u32, export: &str, queries: &[&str], i: &mut Vec<u8>) {
        let mut m = Vec::new();
        encode_meta_request(export, queries, &mut m);
        encode_option(opt, &m, i);
    }

    #[test]
    fn list_meta_contexts_with_prefixes_and_unknown_names() {
        let mut i = client_flags();
        encode_option(OPT_STRUCTURED_REPLY, &[], &mut i);
        meta(OPT_LIST_META_CONTEXT, "", &[], &mut i);
        meta(OPT_LIST_META_CONTEXT, "disk", &["base:"], &mut i);
        meta(OPT_LIST_META_CONTEXT, "disk", &["qemu:"], &mut i);
        meta(OPT_LIST_META_CONTEXT, "disk", &["qemu:dirty-bitmap:", "qemu:dirty-bitmap:b0"], &mut i);
        meta(OPT_LIST_META_CONTEXT, "disk", &["qemu:dirty-bitmap:b1", "nope:x", "qemu:dirty-bitmap:b9"], &mut i);
        meta(OPT_LIST_META_CONTEXT, "disk", &["qemu:dirty-bitmap:b", "qemu", "other:"], &mut i);
        encode_option(OPT_ABORT, &[], &mut i);
        let (out, p) = run_many(&i);
        assert_eq!(p, Ok(Progress::Abort));
        let lists = contexts_of(&replies(&out), OPT_LIST_META_CONTEXT);
        let names = |l: &Vec<(u32, String)>| -> Vec<String> {
            assert!(l.iter().all(|(id, _)| *id == 0), "LIST gives id 0");
            l.iter().map(|(_, n)| n.clone()).collect()
        };
        assert_eq!(names(&lists[0]), MANY);
        assert_eq!(names(&lists[1]), [META_BASE_ALLOCATION]);
        assert_eq!(names(&lists[2]), MANY[1..]);
        assert_eq!(names(&lists[3]), MANY[2..], "each context once, however many queries match");
        assert_eq!(names(&lists[4]), ["qemu:dirty-bitmap:b1"]);
        assert!(lists[5].is_empty(), "no partial names, no namespace without its colon");
    }

    #[test]
    fn set_meta_contexts_selects_several_with_unique_ids() {
        let mut i = client_flags();
        encode_option(OPT_EXTENDED_HEADERS, &[], &mut i);
        // Prefixes select nothing in SET; unknown names are skipped.
        meta(OPT_SET_META_CONTEXT, "", &["qemu:", "base:", "qemu:dirty-bitmap:b0"], &mut i);
        meta(
            OPT_SET_META_CONTEXT,
            "disk",
            &["qemu:dirty-bitmap:b1", "nope", META_BASE_ALLOCATION, "qemu:dirty-bitmap:b1"],
            &mut i,
        );
        let mut g = Vec::new();
        encode_info_request("", &[], &mut g);
        encode_option(OPT_GO, &g, &mut i);
        let (out, p) = run_many(&i);
        let Ok(Progress::Transmission(n)) = p else { panic!("{p:?}") };
        let sets = contexts_of(&replies(&out), OPT_SET_META_CONTEXT);
        assert_eq!(sets[0], vec![(1, "qemu:dirty-bitmap:b0".to_string())]);
        // In the export's order, new ids: never one given before on this connection.
        assert_eq!(sets[1], vec![(2, META_BASE_ALLOCATION.to_string()), (3, "qemu:dirty-bitmap:b1".to_string())]);
        assert_eq!(n.meta_contexts, vec![(2, 0), (3, 3)]);
        assert_ne!(n.flags & FLAG_BLOCK_STATUS_PAYLOAD, 0);
        assert_eq!(n.session().meta_contexts, n.meta_contexts);
    }

    #[test]
    fn set_meta_context_edge_cases() {
        // No queries: nothing selected. A failed SET forgets the previous selection.
        let mut i = client_flags();
        encode_option(OPT_STRUCTURED_REPLY, &[], &mut i);
        meta(OPT_SET_META_CONTEXT, "disk", &[META_BASE_ALLOCATION], &mut i);
        meta(OPT_SET_META_CONTEXT, "missing", &[META_BASE_ALLOCATION], &mut i);
        let mut g = Vec::new();
        encode_info_request("disk", &[], &mut g);
        encode_option(OPT_GO, &g, &mut i);
        let (out, p) = run_many(&i);
        let Ok(Progress::Transmission(n)) = p else { panic!("{p:?}") };
        assert!(n.meta_contexts.is_empty());
        assert_eq!(n.flags & FLAG_BLOCK_STATUS_PAYLOAD, 0);
        let r = replies(&out);
        assert_eq!(r[3].1, REP_ERR_UNKNOWN);
        let mut i = client_flags();
        encode_option(OPT_EXTENDED_HEADERS, &[], &mut i);
        meta(OPT_SET_META_CONTEXT, "disk", &[], &mut i);
        encode_option(OPT_GO, &g, &mut i);
        let (out, p) = run_many(&i);
        let Ok(Progress::Transmission(n)) = p else { panic!("{p:?}") };
        assert!(n.meta_contexts.is_empty());
        assert_eq!(contexts_of(&replies(&out), OPT_SET_META_CONTEXT), vec![vec![]]);
    }

    #[test]
    fn meta_context_limits() {
        let mut i = client_flags();
        encode_option(OPT_STRUCTURED_REPLY, &[], &mut i);
        // A query longer than 4096 bytes, a count larger than the data, trailing bytes.
        let long = "q".repeat(MAX_STRING + 1);
        meta(OPT_LIST_META_CONTEXT, "disk", &[&long], &mut i);
        let mut m = Vec::new();
        encode_meta_request("disk", &[], &mut m);
        m[8..12].copy_from_slice(&u32::MAX.to_be_bytes());
        encode_option(OPT_SET_META_CONTEXT, &m, &mut i);
        let mut m = Vec::new();
        encode_meta_request("disk", &[META_BASE_ALLOCATION], &mut m);
        m.push(0);
        encode_option(OPT_SET_META_CONTEXT, &m, &mut i);
        // Thousands of queries in the 64 KiB an option may hold: fine, each context once.
        let many: Vec<&str> = std::iter::repeat_n(META_BASE_ALLOCATION, 3000).collect();
        meta(OPT_SET_META_CONTEXT, "disk", &many, &mut i);
        encode_option(OPT_ABORT, &[], &mut i);
        let (out, p) = run_many(&i);
        assert_eq!(p, Ok(Progress::Abort));
        let r = replies(&out);
        assert_eq!(r[1].1, REP_ERR_INVALID);
        assert_eq!(r[2].1, REP_ERR_INVALID);
        assert_eq!(r[3].1, REP_ERR_INVALID);
        assert_eq!(contexts_of(&r, OPT_SET_META_CONTEXT).last().unwrap(), &vec![(1, META_BASE_ALLOCATION.to_string())]);
        // Before structured replies: refused.
        let mut i = client_flags();
        meta(OPT_LIST_META_CONTEXT, "disk", &[], &mut i);
        let (out, _) = run_many(&i);
        assert_eq!(replies(&out)[0].1, REP_ERR_INVALID);
    }

    #[test]
    fn unknown_option_keeps_connection_usable() {
        let mut i = client_flags();
        encode_option(99, b"junk", &mut i);
        encode_option(OPT_STARTTLS, &[], &mut i);
        encode_option(OPT_LIST, &[], &mut i);
        encode_option(OPT_ABORT, &[], &mut i);
        let (out, p) = run(&i);
        assert_eq!(p, Ok(Progress::Abort));
        let r = replies(&out);
        assert_eq!(r[0].1, REP_ERR_UNSUP);
        assert_eq!(r[1].1, REP_ERR_UNSUP);
        assert_eq!(r[2].1, REP_SERVER);
        assert_eq!(r[3].1, REP_ACK);
        assert_eq!(r[4], (OPT_ABORT, REP_ACK, vec![]));
    }

    #[test]
    fn tls_require_answers_only_starttls_and_abort() {
        let mut out = Vec::new();
        let mut hs = ServerHandshake::with_tls(&mut out, TlsPolicy::Require);
        let mut i = client_flags();
        encode_option(OPT_LIST, &[], &mut i);
        encode_option(OPT_STRUCTURED_REPLY, &[], &mut i);
        let mut g = Vec::new();
        encode_info_request("disk", &[], &mut g);
        encode_option(OPT_INFO, &g, &mut i);
        encode_option(OPT_STARTTLS, &[], &mut i);
        let (out, p) = run_on(&mut hs, &i, out);
        assert_eq!(p, Ok(Progress::StartTls));
        let r = replies(&out);
        assert_eq!(r.len(), 4);
        for x in &r[..3] {
            assert_eq!(x.1, REP_ERR_TLS_REQD, "{x:?}");
        }
        assert!(!r.iter().any(|x| x.1 == REP_SERVER || x.1 == REP_INFO), "nothing leaks before TLS");
        assert_eq!(r[3], (OPT_STARTTLS, REP_ACK, vec![]));
        // After the upgrade: everything works, plaintext state is forgotten, and a second
        // STARTTLS is invalid.
        hs.tls_started();
        let mut i = Vec::new();
        encode_option(OPT_STARTTLS, &[], &mut i);
        encode_option(OPT_GO, &g, &mut i);
        let (out, p) = run_on(&mut hs, &i, vec![0; 18]);
        let Ok(Progress::Transmission(n)) = p else { panic!("{p:?}") };
        assert_eq!(n.mode, ReplyMode::Simple);
        assert_eq!(replies(&out)[0].1, REP_ERR_INVALID);
        // EXPORT_NAME before TLS has no error reply: the connection is dropped.
        let mut out = Vec::new();
        let mut hs = ServerHandshake::with_tls(&mut out, TlsPolicy::Require);
        let mut i = client_flags();
        encode_option(OPT_EXPORT_NAME, b"disk", &mut i);
        assert_eq!(run_on(&mut hs, &i, out).1, Err(HandshakeError::TlsRequired));
    }

    #[test]
    fn tls_on_allows_plaintext_and_off_refuses_starttls() {
        let mut out = Vec::new();
        let mut hs = ServerHandshake::with_tls(&mut out, TlsPolicy::On);
        let mut i = client_flags();
        encode_option(OPT_LIST, &[], &mut i);
        encode_option(OPT_STARTTLS, b"x", &mut i);
        encode_option(OPT_STARTTLS, &[], &mut i);
        let (out, p) = run_on(&mut hs, &i, out);
        assert_eq!(p, Ok(Progress::StartTls));
        let r = replies(&out);
        assert_eq!(r[0].1, REP_SERVER);
        assert_eq!(r[2].1, REP_ERR_INVALID);
        assert_eq!(r[3], (OPT_STARTTLS, REP_ACK, vec![]));
        let mut i = client_flags();
        encode_option(OPT_STARTTLS, &[], &mut i);
        encode_option(OPT_ABORT, &[], &mut i);
        let (out, p) = run(&i);
        assert_eq!(p, Ok(Progress::Abort));
        assert_eq!(replies(&out)[0].1, REP_ERR_UNSUP);
    }

    #[test]
    fn export_name_old_style() {
        let mut i = FLAG_C_FIXED_NEWSTYLE.to_be_bytes().to_vec();
        encode_option(OPT_EXPORT_NAME, b"", &mut i);
        let (out, p) = run(&i);
        assert!(matches!(p, Ok(Progress::Transmission(_))));
        assert_eq!(out.len(), 18 + 8 + 2 + 124);
        let mut i = client_flags();
        encode_option(OPT_EXPORT_NAME, b"nope", &mut i);
        assert_eq!(run(&i).1, Err(HandshakeError::UnknownExport("nope".into())));
    }

    #[test]
    fn oversized_option_is_skipped_not_buffered() {
        let mut i = client_flags();
        i.extend_from_slice(&IHAVEOPT.to_be_bytes());
        i.extend_from_slice(&OPT_GO.to_be_bytes());
        i.extend_from_slice(&(MAX_OPTION_DATA + 10).to_be_bytes());
        i.extend(std::iter::repeat_n(0u8, MAX_OPTION_DATA as usize + 10));
        encode_option(OPT_ABORT, &[], &mut i);
        let (out, p) = run(&i);
        assert_eq!(p, Ok(Progress::Abort));
        let r = replies(&out);
        assert_eq!(r[0].1, REP_ERR_TOO_BIG);
    }

    #[test]
    fn oversized_options_before_starttls_get_tls_reqd_under_require() {
        let big = |opt: u32, i: &mut Vec<u8>| {
            i.extend_from_slice(&IHAVEOPT.to_be_bytes());
            i.extend_from_slice(&opt.to_be_bytes());
            i.extend_from_slice(&(MAX_OPTION_DATA + 10).to_be_bytes());
            i.extend(std::iter::repeat_n(0u8, MAX_OPTION_DATA as usize + 10));
        };
        let mut out = Vec::new();
        let mut hs = ServerHandshake::with_tls(&mut out, TlsPolicy::Require);
        let mut i = client_flags();
        big(OPT_GO, &mut i);
        big(OPT_LIST, &mut i);
        big(OPT_STARTTLS, &mut i);
        encode_option(OPT_ABORT, &[], &mut i);
        let (out, p) = run_on(&mut hs, &i, out);
        assert_eq!(p, Ok(Progress::Abort));
        let r: Vec<(u32, u32)> = replies(&out).iter().map(|x| (x.0, x.1)).collect();
        assert_eq!(
            r,
            vec![
                (OPT_GO, REP_ERR_TLS_REQD),
                (OPT_LIST, REP_ERR_TLS_REQD),
                (OPT_STARTTLS, REP_ERR_TOO_BIG),
                (OPT_ABORT, REP_ACK)
            ]
        );
        // EXPORT_NAME: dropped for want of TLS, whatever its length.
        let mut out = Vec::new();
        let mut hs = ServerHandshake::with_tls(&mut out, TlsPolicy::Require);
        let mut i = client_flags();
        big(OPT_EXPORT_NAME, &mut i);
        assert_eq!(run_on(&mut hs, &i, out).1, Err(HandshakeError::TlsRequired));
    }

    #[test]
    fn errors_and_bad_input() {
        let mut i = client_flags();
        let mut g = Vec::new();
        encode_info_request("missing", &[], &mut g);
        encode_option(OPT_GO, &g, &mut i);
        encode_option(OPT_GO, &[1, 2, 3], &mut i);
        let mut m = Vec::new();
        encode_meta_request("", &[], &mut m);
        encode_option(OPT_SET_META_CONTEXT, &m, &mut i);
        encode_option(OPT_LIST, b"x", &mut i);
        let (out, p) = run(&i);
        assert_eq!(p, Ok(Progress::Continue));
        let r = replies(&out);
        assert_eq!(r[0].1, REP_ERR_UNKNOWN);
        assert_eq!(r[1].1, REP_ERR_INVALID);
        assert_eq!(r[2].1, REP_ERR_INVALID); // no structured replies yet
        assert_eq!(r[3].1, REP_ERR_INVALID);
        assert_eq!(run(&[0, 0, 0, 4]).1, Err(HandshakeError::BadClientFlags(4)));
        let mut i = client_flags();
        i.extend_from_slice(&[0u8; 16]);
        assert!(matches!(run(&i).1, Err(HandshakeError::BadOptionMagic(0))));
    }
}
