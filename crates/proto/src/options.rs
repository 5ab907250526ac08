//! Parsers for option data sent during the handshake. Every length is checked against
//! the bytes actually present before anything is allocated for it.
//! (proto.md "Option types")

use crate::consts::MAX_STRING;
use crate::request::{be16, be32};

/// Option data that does not parse: answered with `NBD_REP_ERR_INVALID`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OptionError {
    #[error("option data is truncated: {0}")]
    Truncated(&'static str),
    #[error("option data has {0} trailing bytes")]
    Trailing(usize),
    #[error("string is longer than 4096 bytes")]
    StringTooLong,
    #[error("string is not valid UTF-8")]
    NotUtf8,
    #[error("option takes no data")]
    UnexpectedData,
}

/// Data of `NBD_OPT_INFO` and `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub requests: Vec<u16>,
}

/// Data of `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    pub export: String,
    pub queries: Vec<String>,
}

/// A cursor over option data that refuses to read past the end.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], OptionError> {
        if self.buf.len() < n {
            return Err(OptionError::Truncated(what));
        }
        let (a, b) = self.buf.split_at(n);
        self.buf = b;
        Ok(a)
    }
    fn u16(&mut self, what: &'static str) -> Result<u16, OptionError> {
        Ok(be16(self.take(2, what)?))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, OptionError> {
        Ok(be32(self.take(4, what)?))
    }
    /// A string prefixed by its 32-bit length.
    fn string(&mut self, what: &'static str) -> Result<String, OptionError> {
        let len = self.u32(what)? as usize;
        if len > MAX_STRING {
            return Err(OptionError::StringTooLong);
        }
        parse_string(self.take(len, what)?)
    }
    fn finish(self) -> Result<(), OptionError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(OptionError::Trailing(self.buf.len()))
        }
    }
}

/// An export name or other string: at most 4096 bytes of UTF-8.
pub fn parse_string(b: &[u8]) -> Result<String, OptionError> {
    if b.len() > MAX_STRING {
        return Err(OptionError::StringTooLong);
    }
    String::from_utf8(b.to_vec()).map_err(|_| OptionError::NotUtf8)
}

/// Parses `NBD_OPT_INFO`/`NBD_OPT_GO` data.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest, OptionError> {
    let mut r = Reader { buf: data };
    let name = r.string("export name")?;
    let n = r.u16("number of information requests")? as usize;
    // Bounded by the data present: n is checked before the Vec grows past it.
    let list = r.take(n * 2, "information requests")?;
    let requests = list.chunks_exact(2).map(be16).collect();
    r.finish()?;
    Ok(InfoRequest { name, requests })
}

/// Parses `NBD_OPT_LIST_META_CONTEXT`/`NBD_OPT_SET_META_CONTEXT` data.
pub fn parse_meta_request(data: &[u8]) -> Result<MetaRequest, OptionError> {
    let mut r = Reader { buf: data };
    let export = r.string("export name")?;
    let n = r.u32("number of queries")?;
    // Each query needs at least its 4-byte length, so `n` cannot exceed what is present.
    if u64::from(n) * 4 > r.buf.len() as u64 {
        return Err(OptionError::Truncated("queries"));
    }
    let mut queries = Vec::with_capacity(n as usize);
    for _ in 0..n {
        queries.push(r.string("query")?);
    }
    r.finish()?;
    Ok(MetaRequest { export, queries })
}

/// Encodes `NBD_OPT_INFO`/`NBD_OPT_GO` data (for clients and tests).
pub fn encode_info_request(name: &str, requests: &[u16], out: &mut Vec<u8>) {
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(requests.len() as u16).to_be_bytes());
    for r in requests {
        out.extend_from_slice(&r.to_be_bytes());
    }
}

/// Encodes meta-context option data (for clients and tests).
pub fn encode_meta_request(export: &str, queries: &[&str], out: &mut Vec<u8>) {
    out.extend_from_slice(&(export.len() as u32).to_be_bytes());
    out.extend_from_slice(export.as_bytes());
    out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        out.extend_from_slice(&(q.len() as u32).to_be_bytes());
        out.extend_from_slice(q.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_round_trip() {
        let mut b = Vec::new();
        encode_info_request("disk", &[3, 1], &mut b);
        assert_eq!(parse_info_request(&b), Ok(InfoRequest { name: "disk".into(), requests: vec![3, 1] }));
        assert!(parse_info_request(&b[..b.len() - 1]).is_err());
        b.push(0);
        assert_eq!(parse_info_request(&b), Err(OptionError::Trailing(1)));
    }

    #[test]
    fn huge_counts_do_not_allocate() {
        // name length 0, 4 billion queries, no data.
        let b = [0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff];
        assert!(parse_meta_request(&b).is_err());
        // name length claims 4 GiB.
        let b = [0xff, 0xff, 0xff, 0xff];
        assert_eq!(parse_info_request(&b), Err(OptionError::StringTooLong));
    }

    #[test]
    fn meta_round_trip() {
        let mut b = Vec::new();
        encode_meta_request("", &["base:allocation", "qemu:dirty-bitmap:x"], &mut b);
        let m = parse_meta_request(&b).unwrap();
        assert_eq!(m.queries.len(), 2);
        assert_eq!(m.queries[0], "base:allocation");
        assert_eq!(parse_string(&[0xff]), Err(OptionError::NotUtf8));
    }
}
