//! The `:authority` gRPC clients send over a Unix socket, made acceptable to the server.
//!
//! # The problem
//!
//! A gRPC client dialing a Unix socket has no host name to send, and several send the socket
//! path, or a percent-encoding of it, as the HTTP/2 `:authority`:
//!
//! - kubelet before 1.26: the device manager dialed `grpc.DialContext(ctx, socketPath, ...)`
//!   with a custom dialer, and grpc-go then takes the target (the path) as the authority
//!   (grpc-go `clientconn.go`: `cc.authority = cc.parsedTarget.Endpoint` unless the target
//!   starts with `unix:`). Fixed by kubernetes/kubernetes#112597 ("grpc: set localhost
//!   Authority to unix client calls", merged September 2022, in 1.26), which added
//!   `grpc.WithAuthority("localhost")` to `dial` in
//!   `pkg/kubelet/cm/devicemanager/plugin/v1beta1/client.go`.
//! - grpc-java over a `DomainSocketAddress`: the path (grpc/grpc-java#12664).
//! - grpcio (gRPC C-core, Python) from 1.57 with `unix:` targets: the path percent-encoded
//!   (grpc/grpc#38142, after grpc/grpc#33571); grpcio 1.85.3 dialing `unix:/tmp/d/x.sock`
//!   sends `tmp%2Fd%2Fx.sock` (seen with `GRPC_TRACE=http`).
//! - others: grpc-dart before grpc/grpc-dart#577, grpc-swift-nio-transport#176, grpcurl before
//!   fullstorydev/grpcurl#445.
//!
//! tonic serves HTTP/2 through hyper, and hyper through the h2 crate, which parses `:authority`
//! with `http::uri::Authority` and answers a request whose value does not parse ('/' and a
//! '%' in a host are refused) with RST_STREAM(PROTOCOL_ERROR) before hyper or tonic see it
//! (h2 `src/server.rs`, `convert_poll_message`: "malformed headers: malformed authority").
//! Upstream: hyperium/tonic#243 (closed: "grpc-go stopped sending a malformed authority",
//! though reports against newer grpc-go followed), hyperium/h2#442 (closed), hyperium/h2#487
//! (open: "Do not require authority for UNIX domain sockets"), hyperium/hyper#3750 (the h2
//! maintainer: a value with forward slashes is not a valid authority; clients should send
//! another). Neither tonic, hyper nor h2 has a setting to accept it, and h2 rejects the
//! request before any tower layer runs, so a layer cannot help.
//!
//! # The fix
//!
//! [`AuthorityFix`] wraps each accepted connection and reads the client's HTTP/2 frames before
//! h2 does. It decodes every header block (HPACK, following the client's dynamic table); a
//! block whose `:authority` `http::uri::Authority` refuses gets `localhost` instead (what
//! grpc-go, kubelet 1.26+ and grpcurl send over Unix sockets) and is re-encoded as literals
//! that touch no dynamic table. From the first rewrite on the server's HPACK table no longer
//! follows the client's, so every later block of the connection is re-encoded the same way.
//! Until a block needs rewriting, the bytes pass unchanged, and anything this does not follow
//! (not the HTTP/2 preface, a block it cannot decode, a frame out of place) switches it to
//! passing everything unchanged, so h2 answers as it would have. After a rewrite, such a
//! connection is closed instead. Frames other than HEADERS and CONTINUATION are never
//! buffered.
//!
//! Limits: the server's HPACK table is taken to be HTTP/2's default 4096 bytes (tonic does not
//! change it); a header block may be at most 256 KiB compressed and decode to at most 256 KiB
//! (hyper's own limit on a header list is 16 KiB).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The client connection preface.
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame written to the server: HTTP/2's initial SETTINGS_MAX_FRAME_SIZE, which a
/// server always accepts.
const MAX_FRAME: usize = 16_384;
/// The most a header block may carry (all its frames), and decode to.
const MAX_BLOCK: usize = 256 * 1024;
/// HTTP/2's default SETTINGS_HEADER_TABLE_SIZE, the server's decoding table.
const TABLE_SIZE: usize = 4096;
/// What replaces an authority the server would refuse.
pub const REPLACEMENT: &str = "localhost";

/// A connection whose `:authority` values the server would refuse are replaced (see the module
/// documentation). Writes pass straight through.
pub struct AuthorityFix<IO> {
    io: IO,
    /// Read from `io`, not yet looked at.
    input: Vec<u8>,
    /// For the reader, from `out_at`.
    out: Vec<u8>,
    out_at: usize,
    state: State,
    decoder: loona_hpack::Decoder<'static>,
    /// A header block still waiting for its CONTINUATION frames.
    pending: Option<Block>,
    /// The frames of the header block being read, as received.
    held: Vec<u8>,
    /// A block has been rewritten: every later one is re-encoded.
    reencode: bool,
    /// How many `:authority` values were replaced.
    replaced: u64,
    eof: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// How much of the preface has been seen.
    Preface(usize),
    /// At a frame header.
    Frame,
    /// This many more payload bytes of a frame pass unchanged.
    Forward(usize),
    /// Everything passes unchanged from here on.
    Passthrough,
}

/// A header block being collected.
struct Block {
    stream: u32,
    end_stream: bool,
    /// The HEADERS frame's priority fields (stream dependency and weight), if it had them.
    priority: Option<[u8; 5]>,
    fragment: Vec<u8>,
}

/// What went wrong with a frame: before any rewrite, it passes to the server unchanged.
struct Unfollowed;

/// A header block's fields, names and values as bytes.
type Fields = Vec<(Vec<u8>, Vec<u8>)>;

impl<IO> AuthorityFix<IO> {
    pub fn new(io: IO) -> AuthorityFix<IO> {
        let mut decoder = loona_hpack::Decoder::new();
        decoder.set_max_allowed_table_size(TABLE_SIZE);
        AuthorityFix {
            io,
            input: Vec::new(),
            out: Vec::new(),
            out_at: 0,
            state: State::Preface(0),
            decoder,
            pending: None,
            held: Vec::new(),
            reencode: false,
            replaced: 0,
            eof: false,
        }
    }

    /// How many `:authority` values this connection has had replaced.
    pub fn replaced(&self) -> u64 {
        self.replaced
    }

    pub fn get_ref(&self) -> &IO {
        &self.io
    }

    /// Moves what can be decided from `input` to `out`.
    fn process(&mut self) -> io::Result<()> {
        loop {
            match self.state {
                State::Passthrough => {
                    self.out.append(&mut self.input);
                    return Ok(());
                }
                State::Preface(seen) => {
                    let n = (PREFACE.len() - seen).min(self.input.len());
                    if self.input[..n] != PREFACE[seen..seen + n] {
                        // Not HTTP/2 with prior knowledge: not ours to follow.
                        self.state = State::Passthrough;
                        continue;
                    }
                    self.out.extend(self.input.drain(..n));
                    if seen + n < PREFACE.len() {
                        self.state = State::Preface(seen + n);
                        return Ok(());
                    }
                    self.state = State::Frame;
                }
                State::Forward(left) => {
                    let n = left.min(self.input.len());
                    self.out.extend(self.input.drain(..n));
                    if n < left {
                        self.state = State::Forward(left - n);
                        return Ok(());
                    }
                    self.state = State::Frame;
                }
                State::Frame => {
                    if self.input.len() < FRAME_HEADER {
                        return Ok(());
                    }
                    let h = &self.input[..FRAME_HEADER];
                    let len = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
                    let (kind, flags) = (h[3], h[4]);
                    let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
                    let header_frame = kind == HEADERS || kind == CONTINUATION;
                    if !header_frame && self.pending.is_none() {
                        self.out.extend(self.input.drain(..FRAME_HEADER));
                        self.state = State::Forward(len);
                        continue;
                    }
                    let result = if !header_frame || len > MAX_BLOCK {
                        // A frame inside a header block, or a block too large to follow.
                        Err(Unfollowed)
                    } else if self.input.len() < FRAME_HEADER + len {
                        return Ok(());
                    } else {
                        self.held.extend(self.input.drain(..FRAME_HEADER + len));
                        let at = self.held.len() - len;
                        let payload = self.held.split_off(at);
                        let r = self.header_frame(kind, flags, stream, &payload);
                        if self.pending.is_some() || r.is_err() {
                            // Not done with the block: its frames stay held.
                            self.held.extend_from_slice(&payload);
                        }
                        r
                    };
                    if result.is_err() {
                        if self.reencode {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                "HTTP/2 header frames this server cannot follow",
                            ));
                        }
                        // Everything as received: h2 decides.
                        self.pending = None;
                        self.out.append(&mut self.held);
                        self.state = State::Passthrough;
                    }
                }
            }
        }
    }

    /// A HEADERS or CONTINUATION frame's payload (its header, and the block's earlier frames,
    /// in `held`). When the block is complete, it goes to `out`, as received or re-encoded,
    /// and `held` is emptied.
    fn header_frame(
        &mut self,
        kind: u8,
        flags: u8,
        stream: u32,
        payload: &[u8],
    ) -> Result<(), Unfollowed> {
        match (kind, &mut self.pending) {
            (HEADERS, None) => {
                let mut at = 0;
                let mut pad = 0;
                if flags & PADDED != 0 {
                    pad = usize::from(*payload.first().ok_or(Unfollowed)?);
                    at = 1;
                }
                let mut priority = None;
                if flags & PRIORITY != 0 {
                    let p: [u8; 5] = payload
                        .get(at..at + 5)
                        .and_then(|p| p.try_into().ok())
                        .ok_or(Unfollowed)?;
                    priority = Some(p);
                    at += 5;
                }
                let end = payload.len().checked_sub(pad).ok_or(Unfollowed)?;
                let fragment = payload.get(at..end).ok_or(Unfollowed)?.to_vec();
                self.pending = Some(Block {
                    stream,
                    end_stream: flags & END_STREAM != 0,
                    priority,
                    fragment,
                });
            }
            (CONTINUATION, Some(b)) if b.stream == stream => {
                // The frames held count too: empty CONTINUATION frames without end would grow
                // `held` by their 9-byte headers for ever (h2's own CONTINUATION-flood guard
                // never sees what this layer holds).
                if b.fragment.len() + payload.len() > MAX_BLOCK || self.held.len() > 2 * MAX_BLOCK {
                    return Err(Unfollowed);
                }
                b.fragment.extend_from_slice(payload);
            }
            _ => return Err(Unfollowed),
        }
        if flags & END_HEADERS == 0 {
            return Ok(());
        }
        let b = self.pending.take().ok_or(Unfollowed)?;
        let fields = self.decode(&b)?;
        let mut bad_authority = false;
        let fields: Fields = fields
            .into_iter()
            .map(|(name, value)| {
                if name == b":authority" && http::uri::Authority::try_from(&value[..]).is_err() {
                    bad_authority = true;
                    (name, REPLACEMENT.as_bytes().to_vec())
                } else {
                    (name, value)
                }
            })
            .collect();
        if bad_authority {
            self.replaced += 1;
            self.reencode = true;
        }
        if self.reencode {
            self.held.clear();
            write_block(&mut self.out, &b, &fields);
        } else {
            self.out.append(&mut self.held);
            self.out.extend_from_slice(payload);
        }
        Ok(())
    }

    /// The block's fields, following the client's dynamic table.
    fn decode(&mut self, b: &Block) -> Result<Fields, Unfollowed> {
        let mut fields = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(&b.fragment, |name, value| {
                // Counted whole, kept only while under the bound (an indexed field of a few
                // bytes can stand for 4 KiB).
                size = size.saturating_add(name.len() + value.len() + 32);
                if size <= MAX_BLOCK {
                    fields.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|_| Unfollowed)?;
        if size > MAX_BLOCK {
            return Err(Unfollowed);
        }
        Ok(fields)
    }
}

/// HPACK's integer with an `n`-bit prefix, the prefix's other bits `first`.
fn put_int(out: &mut Vec<u8>, first: u8, n: u32, mut v: usize) {
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

/// The fields as a header block of literals without indexing (new names, no Huffman coding):
/// the server's dynamic table is left as it is. Written as a HEADERS frame and as many
/// CONTINUATION frames as needed.
fn write_block(out: &mut Vec<u8>, b: &Block, fields: &[(Vec<u8>, Vec<u8>)]) {
    let mut block = Vec::new();
    for (name, value) in fields {
        block.push(0x00);
        put_int(&mut block, 0x00, 7, name.len());
        block.extend_from_slice(name);
        put_int(&mut block, 0x00, 7, value.len());
        block.extend_from_slice(value);
    }
    let mut first = true;
    let mut rest = &block[..];
    loop {
        let room = if first && b.priority.is_some() {
            MAX_FRAME - 5
        } else {
            MAX_FRAME
        };
        let (chunk, more) = rest.split_at(rest.len().min(room));
        rest = more;
        let mut flags = if rest.is_empty() { END_HEADERS } else { 0 };
        let kind = if first { HEADERS } else { CONTINUATION };
        let mut payload_len = chunk.len();
        if first {
            if b.end_stream {
                flags |= END_STREAM;
            }
            if b.priority.is_some() {
                flags |= PRIORITY;
                payload_len += 5;
            }
        }
        out.extend_from_slice(&(payload_len as u32).to_be_bytes()[1..]);
        out.push(kind);
        out.push(flags);
        out.extend_from_slice(&b.stream.to_be_bytes());
        if first {
            if let Some(p) = b.priority {
                out.extend_from_slice(&p);
            }
        }
        out.extend_from_slice(chunk);
        first = false;
        if rest.is_empty() {
            break;
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for AuthorityFix<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if this.out_at < this.out.len() {
                let n = buf.remaining().min(this.out.len() - this.out_at);
                buf.put_slice(&this.out[this.out_at..this.out_at + n]);
                this.out_at += n;
                if this.out_at == this.out.len() {
                    this.out.clear();
                    this.out_at = 0;
                }
                return Poll::Ready(Ok(()));
            }
            if this.eof {
                // What never completed goes as it came; then the end.
                this.pending = None;
                this.out.append(&mut this.held);
                this.out.append(&mut this.input);
                if this.out.is_empty() {
                    return Poll::Ready(Ok(()));
                }
                continue;
            }
            let mut chunk = [0u8; 8192];
            let mut rb = ReadBuf::new(&mut chunk);
            match Pin::new(&mut this.io).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {
                    if rb.filled().is_empty() {
                        this.eof = true;
                    } else {
                        this.input.extend_from_slice(rb.filled());
                        this.process()?;
                    }
                }
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected
    for AuthorityFix<IO>
{
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.push(kind);
        f.push(flags);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// A literal with incremental indexing, its name at `name` in the tables.
    fn indexing(b: &mut Vec<u8>, name: usize, value: &[u8]) {
        put_int(b, 0x40, 6, name);
        put_int(b, 0, 7, value.len());
        b.extend_from_slice(value);
    }

    /// A request as grpc-go encodes it: `:path`, `:authority`, `content-type` into the dynamic
    /// table (`content-type` newest, at 62).
    fn request(authority: &[u8]) -> Vec<u8> {
        let mut b = vec![0x83, 0x86];
        indexing(&mut b, 4, b"/v1beta1.DevicePlugin/Allocate");
        indexing(&mut b, 1, authority);
        indexing(&mut b, 31, b"application/grpc");
        b
    }

    async fn through(input: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        AuthorityFix::new(input)
            .read_to_end(&mut out)
            .await
            .unwrap();
        out
    }

    /// The frames of an HTTP/2 client stream (after the preface): (type, flags, stream,
    /// payload).
    fn frames(mut b: &[u8]) -> Vec<(u8, u8, u32, Vec<u8>)> {
        let mut v = Vec::new();
        while !b.is_empty() {
            let len = usize::from(b[0]) << 16 | usize::from(b[1]) << 8 | usize::from(b[2]);
            let stream = u32::from_be_bytes([b[5], b[6], b[7], b[8]]);
            v.push((b[3], b[4], stream, b[9..9 + len].to_vec()));
            b = &b[9 + len..];
        }
        v
    }

    /// What the server's decoder makes of each header block of `b` (after the preface).
    fn server_view(b: &[u8]) -> Vec<Vec<(String, String)>> {
        let mut d = loona_hpack::Decoder::new();
        let mut blocks = Vec::new();
        let mut block = Vec::new();
        for (kind, flags, _, p) in frames(b) {
            if kind == HEADERS || kind == CONTINUATION {
                assert!(p.len() <= MAX_FRAME);
                let start = if kind == HEADERS && flags & PRIORITY != 0 {
                    5
                } else {
                    0
                };
                block.extend_from_slice(&p[start..]);
                if flags & END_HEADERS != 0 {
                    let fields = d.decode(&block).unwrap();
                    blocks.push(
                        fields
                            .into_iter()
                            .map(|(n, v)| {
                                (String::from_utf8(n).unwrap(), String::from_utf8(v).unwrap())
                            })
                            .collect(),
                    );
                    block.clear();
                }
            }
        }
        blocks
    }

    fn authority(fields: &[(String, String)]) -> &str {
        &fields.iter().find(|(n, _)| n == ":authority").unwrap().1
    }

    #[tokio::test]
    async fn a_valid_authority_passes_byte_for_byte() {
        let mut input = PREFACE.to_vec();
        input.extend(frame(0x4, 0, 0, &[]));
        input.extend(frame(HEADERS, END_HEADERS, 1, &request(b"localhost")));
        input.extend(frame(0x0, END_STREAM, 1, &[0, 0, 0, 0, 0]));
        // A second request from the dynamic table.
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            3,
            &[0x83, 0x86, 0xc0, 0xbf, 0xbe],
        ));
        assert_eq!(through(&input).await, input);
    }

    /// The socket path as authority, then the same request from the dynamic table: both reach
    /// the server with `localhost`, every other field as sent; a request before the rewrite
    /// passes as it came.
    #[tokio::test]
    async fn a_socket_path_authority_becomes_localhost_and_later_blocks_follow() {
        let sock = b"/var/lib/kubelet/device-plugins/cuvisor-gpu-memory.sock";
        let mut before = PREFACE.to_vec();
        before.extend(frame(
            HEADERS,
            END_HEADERS | END_STREAM,
            1,
            &request(b"x:1"),
        ));
        let mut input = before.clone();
        input.extend(frame(HEADERS, END_HEADERS, 3, &request(sock)));
        input.extend(frame(0x0, END_STREAM, 3, &[0, 0, 0, 0, 0]));
        // Indices: 62 content-type, 63 :authority (the path), 64 :path.
        input.extend(frame(
            HEADERS,
            END_HEADERS,
            5,
            &[0x83, 0x86, 0xc0, 0xbf, 0xbe],
        ));
        let out = through(&input).await;
        assert!(
            out.starts_with(&before),
            "the block before the rewrite is unchanged"
        );
        let blocks = server_view(&out[PREFACE.len()..]);
        assert_eq!(blocks.len(), 3);
        assert_eq!(authority(&blocks[0]), "x:1");
        for b in &blocks[1..] {
            assert_eq!(authority(b), REPLACEMENT);
            assert_eq!(
                b.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
                [":method", ":scheme", ":path", ":authority", "content-type"]
            );
            assert_eq!(b[2].1, "/v1beta1.DevicePlugin/Allocate");
        }
        // The DATA frame between them, unchanged; END_STREAM kept on the first block.
        let f = frames(&out[PREFACE.len()..]);
        assert_eq!(f[0].1, END_HEADERS | END_STREAM);
        assert_eq!(f[2], (0x0, END_STREAM, 3, vec![0, 0, 0, 0, 0]));
    }

    /// Padding and priority are read; a rewritten block too long for one frame goes out as a
    /// HEADERS frame and CONTINUATION frames of at most 16 KiB; grpcio's percent-encoded path
    /// and an empty authority are rewritten too.
    #[tokio::test]
    async fn padded_prioritised_and_long_blocks_are_rewritten_whole() {
        let long = vec![b'v'; 40_000];
        let mut b = request(b"%2Frun%2Fplugin.sock");
        b.push(0x00); // a literal without indexing, new name
        put_int(&mut b, 0, 7, 5);
        b.extend_from_slice(b"x-big");
        put_int(&mut b, 0, 7, long.len());
        b.extend_from_slice(&long);
        // Split over a padded, prioritised HEADERS frame and two CONTINUATION frames.
        let (one, rest) = b.split_at(100);
        let (two, three) = rest.split_at(30_000);
        let mut p = vec![3u8]; // pad length
        p.extend_from_slice(&[0, 0, 0, 0, 16]); // priority: no dependency, weight 17
        p.extend_from_slice(one);
        p.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, PADDED | PRIORITY, 1, &p));
        input.extend(frame(CONTINUATION, 0, 1, two));
        input.extend(frame(CONTINUATION, END_HEADERS, 1, three));
        let mut empty = vec![0x83, 0x86];
        indexing(&mut empty, 4, b"/p");
        indexing(&mut empty, 1, b"");
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, 3, &empty));
        let out = through(&input).await;
        let f = frames(&out[PREFACE.len()..]);
        assert_eq!(
            (f[0].0, f[0].1 & PRIORITY, f[0].1 & PADDED),
            (HEADERS, PRIORITY, 0)
        );
        assert_eq!(&f[0].3[..5], &[0, 0, 0, 0, 16]);
        assert!(f.len() >= 4 && f.iter().all(|x| x.3.len() <= MAX_FRAME));
        let blocks = server_view(&out[PREFACE.len()..]);
        assert_eq!(blocks.len(), 2);
        assert_eq!(authority(&blocks[0]), REPLACEMENT);
        assert_eq!(blocks[0].last().unwrap().1.len(), long.len());
        assert_eq!(authority(&blocks[1]), REPLACEMENT);
        assert_eq!(f.last().unwrap().1, END_HEADERS | END_STREAM);
    }

    /// What it cannot follow passes unchanged before a rewrite (h2 then answers as it would
    /// have); after a rewrite, the connection fails.
    #[tokio::test]
    async fn what_it_cannot_follow_passes_unchanged_until_a_rewrite() {
        let http1 = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
        assert_eq!(through(&http1).await, http1);
        let mut bad = PREFACE.to_vec();
        bad.extend(frame(
            HEADERS,
            END_HEADERS,
            1,
            &[0xff, 0xff, 0xff, 0xff, 0x0f],
        ));
        bad.extend(frame(HEADERS, END_HEADERS, 3, &request(b"/a.sock")));
        assert_eq!(
            through(&bad).await,
            bad,
            "an undecodable block: passthrough"
        );
        let mut interleaved = PREFACE.to_vec();
        interleaved.extend(frame(HEADERS, 0, 1, &request(b"/a.sock")));
        interleaved.extend(frame(0x8, 0, 0, &[0, 0, 1, 0]));
        assert_eq!(through(&interleaved).await, interleaved);
        let mut after = PREFACE.to_vec();
        after.extend(frame(HEADERS, END_HEADERS, 1, &request(b"/a.sock")));
        after.extend(frame(
            HEADERS,
            END_HEADERS,
            3,
            &[0xff, 0xff, 0xff, 0xff, 0x0f],
        ));
        let mut out = Vec::new();
        let e = AuthorityFix::new(&after[..]).read_to_end(&mut out).await;
        assert_eq!(e.unwrap_err().kind(), io::ErrorKind::InvalidData);
    }

    /// A HEADERS frame without END_HEADERS and then empty CONTINUATION frames, without end:
    /// what is held stays bounded (once, it grew by 9 bytes a frame for as long as the client
    /// sent them, past MAX_BLOCK: h2's own flood guard never saw them). (Found by review.)
    #[test]
    fn an_endless_run_of_empty_continuation_frames_is_not_held() {
        let mut fix = AuthorityFix::new(());
        fix.input.extend_from_slice(PREFACE);
        fix.input.extend(frame(HEADERS, 0, 1, &[0x82])); // :method GET, no END_HEADERS
        fix.process().unwrap();
        let empty = frame(CONTINUATION, 0, 1, &[]);
        for _ in 0..4 * MAX_BLOCK / empty.len() {
            fix.input.extend_from_slice(&empty);
            fix.process().unwrap();
            assert!(
                fix.held.len() <= 2 * MAX_BLOCK + empty.len(),
                "{} held",
                fix.held.len()
            );
        }
    }

    #[test]
    fn hpack_integers() {
        for (n, v, want) in [
            (5, 10, vec![10u8]),
            (5, 1337, vec![31, 154, 10]),
            (8, 42, vec![42]),
            (7, 127, vec![127, 0]),
        ] {
            let mut b = Vec::new();
            put_int(&mut b, 0, n, v);
            assert_eq!(b, want, "{v} with a {n}-bit prefix");
        }
    }
}
