//! Sizes as Kubernetes writes them ("6Gi", "512Mi", "4G", "6442450944"), and the two forms of a
//! memory limit (`CUVISOR_MEMORY_LIMIT`, `cuvisor run --memory`): one size for every visible
//! device, or one per CUDA device ordinal ("0=6Gi,1=2Gi").
//!
//! Plain Rust with no dependencies, shared by the library's configuration, the CLI and the
//! device plugin, so that every part accepts and refuses the same texts. Errors say what is wrong
//! without repeating the text; the caller says where it came from (`--memory 4GB: unknown unit
//! "GB" (...)`).

use std::fmt;

/// The units a size may carry, as the error message lists them.
pub const UNITS: &str = "Ki, Mi, Gi, Ti, k, M, G, T or plain bytes";

/// Why a text is not a size (or not a usable memory limit).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuantityError {
    Empty,
    Negative,
    /// No digits where the number should be ("Gi", "abc"), or not one number ("1.2.3").
    NotANumber,
    UnknownUnit(String),
    /// More than u64::MAX bytes.
    TooLarge,
    /// A limit of 0 bytes (sizes may be 0; limits may not).
    Zero,
}

impl fmt::Display for QuantityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QuantityError::Empty => write!(f, "empty (give a size such as 6Gi, 512Mi or 4G)"),
            QuantityError::Negative => write!(f, "a size cannot be negative"),
            QuantityError::NotANumber => write!(
                f,
                "not a size (a number with an optional unit, such as 6Gi, 512Mi or 4G)"
            ),
            QuantityError::UnknownUnit(u) => write!(f, "unknown unit {u:?} (use {UNITS})"),
            QuantityError::TooLarge => write!(f, "too large (more than 2^64-1 bytes)"),
            QuantityError::Zero => write!(f, "a memory limit must be more than 0 bytes"),
        }
    }
}

impl std::error::Error for QuantityError {}

/// Digits kept after the decimal point; later ones can add at most one byte, which the rounding
/// up below accounts for.
const MAX_FRACTION_DIGITS: usize = 18;

/// Parses a size in bytes: "6Gi", "512Mi", "1.5Gi", "4G" (4,000,000,000), "6442450944".
/// Binary units Ki Mi Gi Ti, decimal k M G T; a fractional byte count rounds up, as Kubernetes
/// rounds memory quantities. Exact integer arithmetic, no floating point.
pub fn parse_quantity(text: &str) -> Result<u64, QuantityError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(QuantityError::Empty);
    }
    if t.starts_with('-') {
        return Err(QuantityError::Negative);
    }
    let t = t.strip_prefix('+').unwrap_or(t);
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    if !number.bytes().any(|b| b.is_ascii_digit()) {
        return Err(QuantityError::NotANumber);
    }
    let multiplier: u128 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        other => return Err(QuantityError::UnknownUnit(other.to_string())),
    };
    let (whole, fraction) = match number.split_once('.') {
        Some((w, f)) if !f.contains('.') => (w, f),
        Some(_) => return Err(QuantityError::NotANumber),
        None => (number, ""),
    };
    // Digits only from here on; "" is zero ("0.5" and ".5" alike).
    let mut bytes: u128 = 0;
    for d in whole.bytes() {
        bytes = bytes
            .checked_mul(10)
            .and_then(|b| b.checked_add(u128::from(d - b'0')))
            .ok_or(QuantityError::TooLarge)?;
        if bytes > u128::from(u64::MAX) {
            return Err(QuantityError::TooLarge);
        }
    }
    bytes = bytes
        .checked_mul(multiplier)
        .ok_or(QuantityError::TooLarge)?;
    if !fraction.is_empty() {
        let (kept, dropped) = fraction.split_at(fraction.len().min(MAX_FRACTION_DIGITS));
        let mut numerator: u128 = 0;
        for d in kept.bytes() {
            numerator = numerator * 10 + u128::from(d - b'0');
        }
        let denominator = 10u128.pow(kept.len() as u32);
        // < 10^18 * 2^40: no overflow.
        let scaled = numerator * multiplier;
        let mut part = scaled / denominator;
        if !scaled.is_multiple_of(denominator) || dropped.bytes().any(|d| d != b'0') {
            part += 1;
        }
        bytes = bytes.checked_add(part).ok_or(QuantityError::TooLarge)?;
    }
    u64::try_from(bytes).map_err(|_| QuantityError::TooLarge)
}

/// A size that must be more than zero: a memory limit.
pub fn parse_limit(text: &str) -> Result<u64, QuantityError> {
    match parse_quantity(text)? {
        0 => Err(QuantityError::Zero),
        n => Ok(n),
    }
}

/// A device-memory limit: one for every visible device, or one per CUDA device ordinal.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryLimit {
    All(u64),
    /// (ordinal, bytes), in the order given; each ordinal once.
    PerDevice(Vec<(u32, u64)>),
}

/// Why a memory-limit text was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitError {
    /// The whole text, or one device's size, is not a usable size.
    Size {
        ordinal: Option<u32>,
        error: QuantityError,
    },
    /// An entry of the per-device form that is not ORDINAL=SIZE.
    Entry(String),
    Duplicate(u32),
}

impl fmt::Display for LimitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitError::Size {
                ordinal: None,
                error,
            } => write!(f, "{error}"),
            LimitError::Size {
                ordinal: Some(o),
                error,
            } => write!(f, "device {o}: {error}"),
            LimitError::Entry(e) if e.trim().is_empty() => write!(
                f,
                "an empty entry (the form is ORDINAL=SIZE,..., such as 0=6Gi,1=2Gi)"
            ),
            LimitError::Entry(e) => write!(
                f,
                "{e:?} is not ORDINAL=SIZE (the form is ORDINAL=SIZE,..., such as 0=6Gi,1=2Gi)"
            ),
            LimitError::Duplicate(o) => write!(f, "device {o} is given twice"),
        }
    }
}

impl std::error::Error for LimitError {}

impl MemoryLimit {
    /// "6Gi" (every device) or "0=6Gi,1=2Gi" (per CUDA ordinal). Every size must be > 0.
    pub fn parse(text: &str) -> Result<MemoryLimit, LimitError> {
        if text.contains('=') {
            Self::parse_per_device(text)
        } else {
            parse_limit(text)
                .map(MemoryLimit::All)
                .map_err(|error| LimitError::Size {
                    ordinal: None,
                    error,
                })
        }
    }

    /// Only the per-device form, "0=6Gi,1=2Gi".
    pub fn parse_per_device(text: &str) -> Result<MemoryLimit, LimitError> {
        let mut out: Vec<(u32, u64)> = Vec::new();
        for entry in text.split(',') {
            let Some((ordinal, size)) = entry.split_once('=') else {
                return Err(LimitError::Entry(entry.to_string()));
            };
            let o = ordinal.trim();
            if o.is_empty() || !o.bytes().all(|b| b.is_ascii_digit()) {
                return Err(LimitError::Entry(entry.to_string()));
            }
            let ordinal: u32 = o
                .parse()
                .map_err(|_| LimitError::Entry(entry.to_string()))?;
            if out.iter().any(|&(seen, _)| seen == ordinal) {
                return Err(LimitError::Duplicate(ordinal));
            }
            let bytes = parse_limit(size).map_err(|error| LimitError::Size {
                ordinal: Some(ordinal),
                error,
            })?;
            out.push((ordinal, bytes));
        }
        Ok(MemoryLimit::PerDevice(out))
    }

    /// The limit for CUDA device `ordinal`; None when the per-device form does not list it.
    pub fn for_device(&self, ordinal: u32) -> Option<u64> {
        match self {
            MemoryLimit::All(b) => Some(*b),
            MemoryLimit::PerDevice(v) => v.iter().find(|(o, _)| *o == ordinal).map(|(_, b)| *b),
        }
    }
}

/// The canonical text, in plain bytes ("6442450944", "0=6442450944,1=2147483648"), which
/// [`MemoryLimit::parse`] reads back to the same value.
impl fmt::Display for MemoryLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryLimit::All(b) => write!(f, "{b}"),
            MemoryLimit::PerDevice(v) => {
                for (i, (o, b)) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{o}={b}")?;
                }
                Ok(())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;
    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    #[test]
    fn kubernetes_sizes() {
        for (text, bytes) in [
            ("6Gi", 6 * GIB),
            ("512Mi", 512 * MIB),
            ("1.5Gi", 3 * GIB / 2),
            ("0.5Ki", 512),
            (".5Ki", 512),
            ("4G", 4_000_000_000),
            ("4k", 4_000),
            ("2T", 2_000_000_000_000),
            ("1Ti", 1 << 40),
            ("6442450944", 6 * GIB),
            (" 6Gi ", 6 * GIB),
            ("+1Ki", KIB),
            ("0", 0),
            // A fractional byte rounds up, as Kubernetes rounds memory.
            ("1.5", 2),
            ("0.1Ki", 103),
            ("0.0000000000000000001Ki", 1),
            ("18446744073709551615", u64::MAX),
        ] {
            assert_eq!(parse_quantity(text), Ok(bytes), "{text:?}");
        }
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        use QuantityError::*;
        for (text, want) in [
            ("", Empty),
            ("  ", Empty),
            ("-1", Negative),
            ("-1Gi", Negative),
            ("Gi", NotANumber),
            ("garbage", NotANumber),
            (".", NotANumber),
            ("1.2.3Gi", NotANumber),
            ("4GB", UnknownUnit("GB".into())),
            ("4gi", UnknownUnit("gi".into())),
            ("6 Gi", UnknownUnit(" Gi".into())),
            ("1e9", UnknownUnit("e9".into())),
            ("18446744073709551616", TooLarge),
            ("16777216Ti", TooLarge),
            ("99999999999999999999999999999999999999999", TooLarge),
        ] {
            assert_eq!(parse_quantity(text), Err(want), "{text:?}");
        }
        assert_eq!(
            parse_quantity("4GB").unwrap_err().to_string(),
            "unknown unit \"GB\" (use Ki, Mi, Gi, Ti, k, M, G, T or plain bytes)"
        );
        assert_eq!(parse_limit("0"), Err(Zero));
        assert_eq!(parse_limit("0Gi"), Err(Zero));
        assert_eq!(parse_limit("1"), Ok(1));
    }

    #[test]
    fn limits_for_all_devices_or_per_ordinal() {
        assert_eq!(MemoryLimit::parse("6Gi"), Ok(MemoryLimit::All(6 * GIB)));
        let per = MemoryLimit::parse("0=6Gi, 1=2Gi").unwrap();
        assert_eq!(
            per,
            MemoryLimit::PerDevice(vec![(0, 6 * GIB), (1, 2 * GIB)])
        );
        assert_eq!(per.for_device(1), Some(2 * GIB));
        assert_eq!(per.for_device(2), None);
        assert_eq!(MemoryLimit::All(5).for_device(7), Some(5));
        // The canonical text reads back to the same limit.
        for l in [per, MemoryLimit::All(4_000_000_000)] {
            assert_eq!(MemoryLimit::parse(&l.to_string()), Ok(l.clone()));
        }
        assert_eq!(
            MemoryLimit::parse("0=6Gi,1=2Gi").unwrap().to_string(),
            "0=6442450944,1=2147483648"
        );
    }

    #[test]
    fn bad_per_device_limits() {
        for (text, want) in [
            ("0=6Gi,0=1Gi", "device 0 is given twice"),
            ("0=6Gi,,1=1Gi", "an empty entry"),
            ("0=6Gi,1", "\"1\" is not ORDINAL=SIZE"),
            ("x=1Gi", "\"x=1Gi\" is not ORDINAL=SIZE"),
            ("-1=1Gi", "\"-1=1Gi\" is not ORDINAL=SIZE"),
            ("1=4GB", "device 1: unknown unit \"GB\""),
            ("1=0", "device 1: a memory limit must be more than 0 bytes"),
            ("1=", "device 1: empty"),
        ] {
            let e = MemoryLimit::parse(text).unwrap_err().to_string();
            assert!(e.starts_with(want), "{text:?}: {e}");
        }
        assert_eq!(
            MemoryLimit::parse("0").unwrap_err().to_string(),
            "a memory limit must be more than 0 bytes"
        );
    }
}
