//! Compute policies as every part writes them (`CUVISOR_COMPUTE`, `compute = ...` in the limits
//! file, `cuvisor run --compute`): `limit=P`, `share=W`, `share=memory`, `none`.
//!
//! Plain Rust with no dependencies, like [`crate::quantity`], so that every part can accept and
//! refuse the same texts. Errors say what is wrong without repeating the text; the caller says
//! where it came from (`--compute limit=150: a limit is a percentage of GPU time, more than 0 and
//! at most 100`). [`ComputePolicy`]'s `Display` writes the canonical text (`limit=30`, `share=1`,
//! `share=memory`, `none`), which [`parse`] reads back to the same policy.
//!
//! The grammar is the library's (`parse_compute` in src/config.rs): spaces around the key and the
//! value are ignored, a limit may end in `%`, numbers are what Rust's `f64` parser reads (`30`,
//! `12.5`, `1e1`).

use std::fmt;

/// The forms a policy takes, as the error message lists them.
pub const FORMS: &str = "limit=P, share=W, share=memory or none";

/// The largest share weight.
pub const MAX_SHARE: f64 = 1e6;

/// A container's compute policy on each of its GPUs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ComputePolicy {
    /// Launches are not throttled.
    None,
    /// At most this percentage of each GPU's time (0 < P <= 100), even when the GPU is idle.
    Limit(f64),
    /// This weight among the containers busy on a GPU (0 < W <= [`MAX_SHARE`]); idle time is
    /// lent to the busy ones.
    Share(f64),
    /// A share weighted by the memory quota's fraction of the GPU (`share=memory`).
    ShareMemory,
}

/// Why a text is not a compute policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ComputeError {
    /// Not one of the forms (an unknown key, no `=`, an empty text).
    Form,
    /// `limit=` with a value that is not a number.
    LimitNotANumber(String),
    /// A limit outside (0, 100].
    LimitRange,
    /// `share=` with a value that is neither a number nor `memory`.
    ShareNotANumber(String),
    /// A weight outside (0, [`MAX_SHARE`]].
    ShareRange,
}

const LIMIT_RANGE: &str = "a limit is a percentage of GPU time, more than 0 and at most 100";
const SHARE_RANGE: &str = "a share is a weight, more than 0 and at most 1000000 (or share=memory)";

impl fmt::Display for ComputeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ComputeError::Form => write!(f, "expected {FORMS}"),
            ComputeError::LimitNotANumber(v) => write!(f, "{v:?} is not a number: {LIMIT_RANGE}"),
            ComputeError::LimitRange => f.write_str(LIMIT_RANGE),
            ComputeError::ShareNotANumber(v) => write!(f, "{v:?} is not a number: {SHARE_RANGE}"),
            ComputeError::ShareRange => f.write_str(SHARE_RANGE),
        }
    }
}

impl std::error::Error for ComputeError {}

/// Parses a compute policy: "limit=30" (or "limit=30%"), "share=2", "share=memory", "none".
pub fn parse(text: &str) -> Result<ComputePolicy, ComputeError> {
    let t = text.trim();
    if t == "none" {
        return Ok(ComputePolicy::None);
    }
    let (key, value) = t.split_once('=').ok_or(ComputeError::Form)?;
    let value = value.trim();
    match key.trim() {
        "limit" => {
            let number = value.strip_suffix('%').unwrap_or(value).trim_end();
            let p: f64 = number
                .parse()
                .map_err(|_| ComputeError::LimitNotANumber(value.to_string()))?;
            if p > 0.0 && p <= 100.0 {
                Ok(ComputePolicy::Limit(p))
            } else {
                Err(ComputeError::LimitRange)
            }
        }
        "share" if value == "memory" => Ok(ComputePolicy::ShareMemory),
        "share" => {
            let w: f64 = value
                .parse()
                .map_err(|_| ComputeError::ShareNotANumber(value.to_string()))?;
            if w > 0.0 && w <= MAX_SHARE {
                Ok(ComputePolicy::Share(w))
            } else {
                Err(ComputeError::ShareRange)
            }
        }
        _ => Err(ComputeError::Form),
    }
}

impl ComputePolicy {
    /// The limit as a fraction of GPU time (0 < f <= 1), for `Limit`.
    pub fn limit_fraction(&self) -> Option<f64> {
        match self {
            ComputePolicy::Limit(p) => Some(p / 100.0),
            _ => None,
        }
    }
}

/// The canonical text: "limit=30", "limit=12.5", "share=1", "share=memory", "none".
impl fmt::Display for ComputePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ComputePolicy::None => f.write_str("none"),
            // f64's Display writes 30.0 as "30" and never uses an exponent.
            ComputePolicy::Limit(p) => write!(f, "limit={p}"),
            ComputePolicy::Share(w) => write!(f, "share={w}"),
            ComputePolicy::ShareMemory => f.write_str("share=memory"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_and_their_canonical_text() {
        for (text, want, canonical) in [
            ("limit=30", ComputePolicy::Limit(30.0), "limit=30"),
            (" limit = 30% ", ComputePolicy::Limit(30.0), "limit=30"),
            ("limit=12.50", ComputePolicy::Limit(12.5), "limit=12.5"),
            ("limit=100", ComputePolicy::Limit(100.0), "limit=100"),
            ("limit=1e1", ComputePolicy::Limit(10.0), "limit=10"),
            ("share=1", ComputePolicy::Share(1.0), "share=1"),
            (" share = 2 ", ComputePolicy::Share(2.0), "share=2"),
            ("share=0.5", ComputePolicy::Share(0.5), "share=0.5"),
            ("share=1000000", ComputePolicy::Share(1e6), "share=1000000"),
            ("share=memory", ComputePolicy::ShareMemory, "share=memory"),
            ("share = memory", ComputePolicy::ShareMemory, "share=memory"),
            ("none", ComputePolicy::None, "none"),
            (" none ", ComputePolicy::None, "none"),
        ] {
            let p = parse(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert_eq!(p, want, "{text:?}");
            assert_eq!(p.to_string(), canonical, "{text:?}");
            assert_eq!(parse(canonical), Ok(p), "{canonical:?} reads back");
        }
        assert_eq!(parse("limit=30").unwrap().limit_fraction(), Some(0.3));
        assert_eq!(parse("share=3").unwrap().limit_fraction(), None);
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        use ComputeError::*;
        for (text, want) in [
            ("", Form),
            ("30", Form),
            ("fair=2", Form),
            ("Limit=30", Form),
            ("limit", Form),
            ("limit=0", LimitRange),
            ("limit=150", LimitRange),
            ("limit=-5", LimitRange),
            ("limit=nan", LimitRange),
            ("limit=inf", LimitRange),
            ("limit=abc", LimitNotANumber("abc".into())),
            ("limit=", LimitNotANumber("".into())),
            ("limit=30%%", LimitNotANumber("30%%".into())),
            ("share=0", ShareRange),
            ("share=-1", ShareRange),
            ("share=2000000", ShareRange),
            ("share=x", ShareNotANumber("x".into())),
            ("share=2%", ShareNotANumber("2%".into())),
        ] {
            assert_eq!(parse(text), Err(want), "{text:?}");
        }
        assert_eq!(
            parse("limit=150").unwrap_err().to_string(),
            "a limit is a percentage of GPU time, more than 0 and at most 100"
        );
        assert_eq!(
            parse("share=0").unwrap_err().to_string(),
            "a share is a weight, more than 0 and at most 1000000 (or share=memory)"
        );
        assert_eq!(
            parse("fair=2").unwrap_err().to_string(),
            "expected limit=P, share=W, share=memory or none"
        );
        assert_eq!(
            parse("limit=abc").unwrap_err().to_string(),
            "\"abc\" is not a number: a limit is a percentage of GPU time, more than 0 and at \
             most 100"
        );
    }
}
