//! A bare HTTP/2 gRPC client over a Unix socket, written frame by frame, so that it can send
//! what tonic's client cannot: any `:authority` (the socket path, as kubelet before 1.26,
//! grpc-java and grpcio send it), HPACK-encoded the way grpc-go's encoder does (literals with
//! incremental indexing, then the same fields again as dynamic-table indices).
#![allow(dead_code)]

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
pub const DATA: u8 = 0x0;
pub const HEADERS: u8 = 0x1;
pub const RST_STREAM: u8 = 0x3;
pub const SETTINGS: u8 = 0x4;
pub const PING: u8 = 0x6;
pub const GOAWAY: u8 = 0x7;
pub const CONTINUATION: u8 = 0x9;
pub const END_STREAM: u8 = 0x1;
pub const ACK: u8 = 0x1;
pub const END_HEADERS: u8 = 0x4;
/// RST_STREAM's PROTOCOL_ERROR.
pub const PROTOCOL_ERROR: u32 = 0x1;

/// HPACK integer with an `n`-bit prefix; `first` holds the prefix's other bits.
pub fn int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

fn string(out: &mut Vec<u8>, s: &[u8]) {
    int(out, 0x00, 7, s.len());
    out.extend_from_slice(s);
}

/// An indexed field (static table 1..=61, dynamic table from 62, newest first).
pub fn indexed(out: &mut Vec<u8>, index: usize) {
    int(out, 0x80, 7, index);
}

/// A literal with incremental indexing whose name is at `name_index`.
pub fn indexing(out: &mut Vec<u8>, name_index: usize, value: &[u8]) {
    int(out, 0x40, 6, name_index);
    string(out, value);
}

/// A literal with incremental indexing and a new name.
pub fn indexing_new(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x40);
    string(out, name);
    string(out, value);
}

/// A literal without indexing whose name is at `name_index`.
pub fn not_indexed(out: &mut Vec<u8>, name_index: usize, value: &[u8]) {
    int(out, 0x00, 4, name_index);
    string(out, value);
}

/// A first gRPC request's header block as grpc-go encodes it: `:method POST` and `:scheme
/// http` from the static table, `:path`, `:authority`, `content-type` and `te` as literals with
/// incremental indexing (so they go into the dynamic table, `te` newest at 62, `:path` at 65).
pub fn first_request(path: &str, authority: &[u8]) -> Vec<u8> {
    let mut b = Vec::new();
    indexed(&mut b, 3); // :method POST
    indexed(&mut b, 6); // :scheme http
    indexing(&mut b, 4, path.as_bytes()); // :path
    indexing(&mut b, 1, authority); // :authority
    indexing(&mut b, 31, b"application/grpc"); // content-type
    indexing_new(&mut b, b"te", b"trailers");
    b
}

/// The same request again on the connection: every field from the tables.
pub fn repeated_request() -> Vec<u8> {
    let mut b = Vec::new();
    for i in [3, 6, 65, 64, 63, 62] {
        indexed(&mut b, i);
    }
    b
}

/// What came back on a stream.
#[derive(Debug, Default)]
pub struct Reply {
    pub headers: Vec<(String, String)>,
    /// DATA payloads, concatenated (gRPC length-prefixed messages).
    pub data: Vec<u8>,
    /// RST_STREAM's error code.
    pub reset: Option<u32>,
    /// GOAWAY's error code.
    pub goaway: Option<u32>,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The first gRPC message's bytes.
    pub fn message(&self) -> Option<&[u8]> {
        let len = u32::from_be_bytes(self.data.get(1..5)?.try_into().ok()?) as usize;
        self.data.get(5..5 + len)
    }
}

pub struct Client {
    s: UnixStream,
    next_stream: u32,
    /// The server's HPACK encoding, followed.
    decoder: loona_hpack::Decoder<'static>,
}

impl Client {
    pub fn connect(path: &Path) -> io::Result<Client> {
        let mut s = UnixStream::connect(path)?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(PREFACE)?;
        let mut c = Client {
            s,
            next_stream: 1,
            decoder: loona_hpack::Decoder::new(),
        };
        c.frame(SETTINGS, 0, 0, &[])?;
        Ok(c)
    }

    pub fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> io::Result<()> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.push(kind);
        f.push(flags);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        self.s.write_all(&f)
    }

    fn read_frame(&mut self) -> io::Result<(u8, u8, u32, Vec<u8>)> {
        let mut h = [0u8; 9];
        self.s.read_exact(&mut h)?;
        let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let mut p = vec![0u8; len];
        self.s.read_exact(&mut p)?;
        Ok((h[3], h[4], stream, p))
    }

    /// A unary call: `block` as one HEADERS frame, then `message` in one DATA frame; reads
    /// until the stream ends (or is reset, or the connection goes away).
    pub fn unary(&mut self, block: &[u8], message: &[u8]) -> io::Result<Reply> {
        self.call(block, message, false)
    }

    /// A server-streaming call, read until its first message.
    pub fn first_message(&mut self, block: &[u8], message: &[u8]) -> io::Result<Reply> {
        self.call(block, message, true)
    }

    fn call(&mut self, block: &[u8], message: &[u8], first_data: bool) -> io::Result<Reply> {
        let id = self.next_stream;
        self.next_stream += 2;
        self.frame(HEADERS, END_HEADERS, id, block)?;
        let mut body = vec![0u8];
        body.extend_from_slice(&(message.len() as u32).to_be_bytes());
        body.extend_from_slice(message);
        self.frame(DATA, END_STREAM, id, &body)?;
        let mut reply = Reply::default();
        let mut block = Vec::new();
        loop {
            let (kind, flags, stream, p) = self.read_frame()?;
            match kind {
                SETTINGS if flags & ACK == 0 => self.frame(SETTINGS, ACK, 0, &[])?,
                PING if flags & ACK == 0 => self.frame(PING, ACK, 0, &p)?,
                GOAWAY => {
                    reply.goaway = Some(u32::from_be_bytes(p[4..8].try_into().unwrap()));
                    return Ok(reply);
                }
                RST_STREAM if stream == id => {
                    reply.reset = Some(u32::from_be_bytes(p[..4].try_into().unwrap()));
                    return Ok(reply);
                }
                HEADERS | CONTINUATION => {
                    // Every block is decoded, whichever stream: the table follows them all.
                    block.extend_from_slice(&p);
                    if flags & END_HEADERS != 0 {
                        let fields = self
                            .decoder
                            .decode(&block)
                            .map_err(|e| io::Error::other(format!("{e:?}")))?;
                        block.clear();
                        if stream == id {
                            for (n, v) in fields {
                                reply.headers.push((
                                    String::from_utf8_lossy(&n).into(),
                                    String::from_utf8_lossy(&v).into(),
                                ));
                            }
                        }
                    }
                    if stream == id && flags & END_STREAM != 0 {
                        return Ok(reply);
                    }
                }
                DATA if stream == id => {
                    reply.data.extend_from_slice(&p);
                    if flags & END_STREAM != 0 || (first_data && reply.message().is_some()) {
                        return Ok(reply);
                    }
                }
                _ => {}
            }
        }
    }
}
