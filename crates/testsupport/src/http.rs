//! HTTP/1.1 pieces for test servers: reading a header block, finding a header in it, and
//! a proxy in front of a local server (nginx) that spoils the requests a rule picks.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;

/// Reads a header block (through the blank line) from `r`; `None` at the end of input.
pub fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<String>> {
    let mut head = String::new();
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return Ok(None);
        }
        head.push_str(&line);
        if line == "\r\n" {
            return Ok(Some(head));
        }
    }
}

/// The value of header `name` (any case) in the header block `head`.
pub fn header(head: &str, name: &str) -> Option<String> {
    head.lines().find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.eq_ignore_ascii_case(name).then(|| v.trim().to_string())
    })
}

/// What the [`proxy`] does with one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Sends it upstream and the answer back.
    Forward,
    /// Answers `503 Service Unavailable` itself.
    Status503,
    /// Answers `416 Range Not Satisfiable` itself.
    Status416,
    /// Closes the connection without an answer.
    Drop,
    /// Sends it upstream, then only the answer's head and half its body, and closes.
    ShortBody,
    /// Sends it upstream and the answer back with one more byte in the total size of its
    /// Content-Range (when it has one).
    SizeChange,
}

/// A proxy to 127.0.0.1:`upstream`, one thread per connection, that does with each
/// request (its header block; bodies are not forwarded) what `rule` says. A CONNECT
/// (ureq reaches http:// URLs through a proxy with CONNECT too) is answered as an
/// established tunnel, without asking `rule`: the requests inside it go upstream like
/// the others. Returns its port.
pub fn proxy(upstream: u16, rule: impl Fn(&str) -> Verdict + Send + Sync + 'static) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let rule = Arc::new(rule);
    std::thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let rule = rule.clone();
            std::thread::spawn(move || {
                let _ = proxy_connection(client, upstream, &*rule);
            });
        }
    });
    port
}

fn proxy_connection(client: TcpStream, upstream: u16, rule: &dyn Fn(&str) -> Verdict) -> std::io::Result<()> {
    let mut reader = BufReader::new(client.try_clone()?);
    let mut client = client;
    let up = TcpStream::connect(("127.0.0.1", upstream))?;
    let mut up_reader = BufReader::new(up.try_clone()?);
    let mut up = up;
    while let Some(req) = read_head(&mut reader)? {
        if req.starts_with("CONNECT ") {
            client.write_all(b"HTTP/1.1 200 Connection established\r\n\r\n")?;
            continue;
        }
        let verdict = rule(&req);
        match verdict {
            Verdict::Status503 => {
                client.write_all(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")?;
                continue;
            }
            Verdict::Status416 => {
                client.write_all(b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\n\r\n")?;
                continue;
            }
            Verdict::Drop => return Ok(()),
            Verdict::Forward | Verdict::ShortBody | Verdict::SizeChange => {}
        }
        up.write_all(req.as_bytes())?;
        let mut head = read_head(&mut up_reader)?.ok_or(std::io::ErrorKind::UnexpectedEof)?;
        let len: usize = if req.starts_with("HEAD ") {
            0
        } else {
            header(&head, "content-length").and_then(|v| v.parse().ok()).unwrap_or(0)
        };
        let mut body = vec![0; len];
        up_reader.read_exact(&mut body)?;
        if let (Verdict::SizeChange, Some(cr)) = (verdict, header(&head, "content-range")) {
            let (range, total) = cr.rsplit_once('/').unwrap();
            let total: u64 = total.parse().unwrap();
            head = head.replace(&cr, &format!("{range}/{}", total + 1));
        }
        client.write_all(head.as_bytes())?;
        if verdict == Verdict::ShortBody {
            client.write_all(&body[..len / 2])?;
            return Ok(());
        }
        client.write_all(&body)?;
    }
    Ok(())
}
