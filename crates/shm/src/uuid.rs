//! GPU UUIDs as NVML and CUDA name them: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" <-> 16 bytes.

/// The 16 bytes of "GPU-5f2ac1de-..." (the "GPU-" prefix and dashes optional), or None.
pub fn parse(s: &str) -> Option<[u8; 16]> {
    let hex: String = s
        .strip_prefix("GPU-")
        .unwrap_or(s)
        .chars()
        .filter(|c| *c != '-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", lower-case hex as nvidia-smi prints it.
pub fn format(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let s = "GPU-5f2ac1de-0000-4000-8000-000000000001";
        assert_eq!(format(&parse(s).unwrap()), s);
        assert_eq!(parse("5f2ac1de000040008000000000000001"), parse(s));
        assert_eq!(parse("GPU-zz"), None);
        assert_eq!(
            parse("GPU-5f2ac1de-0000-4000-8000-00000000000é"),
            None,
            "no panic on non-ASCII"
        );
    }
}
