//! A reader for `nvidia-smi topo -m` (`--matrix`) text.
//!
//! What it accepts, from every driver generation seen in the wild:
//! - cells `X`, `NV#`, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`, and the old name `SOC` for `SYS`
//!   (drivers before NODE/SYS existed printed `SOC` and a legend of "Path traverses ..." or
//!   "Connection traversing ..." lines; the cell names were the same otherwise);
//! - columns for NICs and other devices (`mlx5_0`, `NIC0`, ...) among the GPU columns; their rows
//!   are skipped, their cells in GPU rows must still be valid cells (so that a misaligned row is
//!   caught rather than misread);
//! - the affinity columns `CPU Affinity`, `NUMA Affinity` and `GPU NUMA ID` (any of them may be
//!   absent; `N/A` values are unknown);
//! - tabs or spaces, cells padded (` X `), empty trailing fields, CRLF line ends, and the ANSI
//!   underline some versions wrap the header in;
//! - everything from the `Legend:` line on (legend, `NIC Legend:`) is ignored.
//!
//! The text cannot tell: UUIDs, memory, NVLink generation, and the PCIe path of a pair shown
//! as `NV#`. Those stay `None` in the [`Topology`]. A GPU whose NVLink counts add up to more
//! than a GPU can have ([`MAX_NVLINKS_PER_GPU`]) must reach its peers through NVSwitch; its
//! NVLink pairs are marked `via_switch`.

use super::model::{Gpu, Link, PcieLevel, Topology, DEFAULT_PCIE_LINK_GBPS};
use std::fmt;

/// NVML_NVLINK_MAX_LINKS: no GPU has more NVLinks than this (18 since Hopper).
pub const MAX_NVLINKS_PER_GPU: u32 = 18;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseError {
    /// 1-based line number of the offending line, when there is one.
    pub line: Option<usize>,
    pub kind: ParseErrorKind,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ParseErrorKind {
    /// Nothing but blank lines.
    Empty,
    /// The first non-blank line is not a header starting with `GPU0`.
    NoHeader {
        found: String,
    },
    /// GPU columns are not GPU0..GPU{n-1}, each once.
    GpuColumns {
        columns: Vec<String>,
    },
    /// A header word after the affinity columns started that is no known column.
    UnknownColumn {
        name: String,
    },
    /// A row whose label is no column of the header.
    UnknownRow {
        label: String,
    },
    DuplicateRow {
        gpu: usize,
    },
    MissingRow {
        gpu: usize,
    },
    /// Fewer cells than the header has device columns.
    ShortRow {
        gpu: usize,
        expected: usize,
        found: usize,
    },
    /// More fields than device columns plus affinity columns.
    LongRow {
        gpu: usize,
        expected: usize,
        found: usize,
    },
    /// A cell that is none of X, NV#, PIX, PXB, PHB, NODE, SYS, SOC.
    BadCell {
        gpu: usize,
        column: String,
        cell: String,
    },
    /// A GPU's own cell is not `X`.
    NotSelf {
        gpu: usize,
        cell: String,
    },
    /// `X` between two different GPUs.
    SelfElsewhere {
        a: usize,
        b: usize,
    },
    /// The two halves of the matrix disagree.
    Asymmetric {
        a: usize,
        b: usize,
        ab: String,
        ba: String,
    },
    BadNuma {
        gpu: usize,
        value: String,
    },
    /// The matrix read fine but is not a valid topology (should not happen).
    Invalid(String),
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "nvidia-smi topo -m: ")?;
        if let Some(l) = self.line {
            write!(f, "line {l}: ")?;
        }
        use ParseErrorKind::*;
        match &self.kind {
            Empty => write!(f, "empty input"),
            NoHeader { found } => write!(
                f,
                "expected the header (GPU0 GPU1 ... CPU Affinity ...), found {found:?}"
            ),
            GpuColumns { columns } => write!(
                f,
                "GPU columns must be GPU0..GPU<n-1>, each once; header has {columns:?}"
            ),
            UnknownColumn { name } => write!(
                f,
                "unknown header column {name:?} (known after the devices: CPU Affinity, NUMA Affinity, GPU NUMA ID)"
            ),
            UnknownRow { label } => {
                write!(f, "row {label:?} is not one of the header's columns")
            }
            DuplicateRow { gpu } => write!(f, "GPU{gpu} has two rows"),
            MissingRow { gpu } => write!(f, "GPU{gpu} has a column but no row"),
            ShortRow {
                gpu,
                expected,
                found,
            } => write!(
                f,
                "GPU{gpu} row has {found} cells, the header has {expected} device columns"
            ),
            LongRow {
                gpu,
                expected,
                found,
            } => write!(
                f,
                "GPU{gpu} row has {found} fields, the header has {expected} columns"
            ),
            BadCell { gpu, column, cell } => write!(
                f,
                "GPU{gpu}, column {column}: {cell:?} is not a link (X, NV#, PIX, PXB, PHB, NODE, SYS, SOC)"
            ),
            NotSelf { gpu, cell } => write!(f, "GPU{gpu} with itself is {cell:?}, expected X"),
            SelfElsewhere { a, b } => write!(f, "GPU{a}-GPU{b} is X, which only a GPU with itself is"),
            Asymmetric { a, b, ab, ba } => write!(
                f,
                "GPU{a}-GPU{b} is {ab} but GPU{b}-GPU{a} is {ba}"
            ),
            BadNuma { gpu, value } => write!(
                f,
                "GPU{gpu}: NUMA affinity {value:?} is not a node number or N/A"
            ),
            Invalid(why) => write!(f, "{why}"),
        }
    }
}

impl std::error::Error for ParseError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cell {
    X,
    Nv(u32),
    Pcie(PcieLevel),
}

impl Cell {
    fn parse(s: &str) -> Option<Cell> {
        Some(match s {
            "X" => Cell::X,
            "PIX" => Cell::Pcie(PcieLevel::Single),
            "PXB" => Cell::Pcie(PcieLevel::Multiple),
            "PHB" => Cell::Pcie(PcieLevel::HostBridge),
            "NODE" => Cell::Pcie(PcieLevel::Node),
            "SYS" | "SOC" => Cell::Pcie(PcieLevel::System),
            _ => {
                let n = s.strip_prefix("NV")?;
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                match n.parse::<u32>() {
                    Ok(k) if k > 0 => Cell::Nv(k),
                    _ => return None,
                }
            }
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Column {
    Gpu(usize),
    Other(String),
}

impl Column {
    fn name(&self) -> String {
        match self {
            Column::Gpu(i) => format!("GPU{i}"),
            Column::Other(s) => s.clone(),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Affinity {
    Cpu,
    Numa,
    GpuNuma,
}

fn gpu_label(s: &str) -> Option<usize> {
    let d = s.strip_prefix("GPU")?;
    if d.is_empty() || !d.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    d.parse().ok()
}

/// Removes ANSI CSI sequences (`ESC [ ... final`), such as the header's underline.
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                for d in chars.by_ref() {
                    if ('@'..='~').contains(&d) {
                        break;
                    }
                }
            }
            continue;
        }
        out.push(c);
    }
    out
}

struct Row {
    line: usize,
    cells: Vec<Cell>,
    cpu_affinity: Option<String>,
    numa: Option<u32>,
}

/// Parses `nvidia-smi topo -m` output into a [`Topology`] (see the module docs for what is
/// accepted and what stays unknown).
pub fn parse_topo_matrix(text: &str) -> Result<Topology, ParseError> {
    let err = |line: Option<usize>, kind| ParseError { line, kind };
    let lines: Vec<(usize, String)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, strip_ansi(l)))
        .collect();
    let mut rest = lines.iter().skip_while(|(_, l)| l.trim().is_empty());
    let (header_line, header) = rest.next().ok_or(err(None, ParseErrorKind::Empty))?;
    let header_line = *header_line;
    let words: Vec<&str> = header.split_whitespace().collect();
    if words.first().and_then(|w| gpu_label(w)).is_none() {
        return Err(err(
            Some(header_line),
            ParseErrorKind::NoHeader {
                found: header.trim().to_string(),
            },
        ));
    }

    // Device columns, then the affinity columns (names of several words).
    let mut columns: Vec<Column> = Vec::new();
    let mut affinities: Vec<Affinity> = Vec::new();
    let mut j = 0;
    while j < words.len() {
        let next = |k: usize| words.get(j + k).copied();
        if words[j] == "CPU" && next(1) == Some("Affinity") {
            affinities.push(Affinity::Cpu);
            j += 2;
        } else if words[j] == "NUMA" && next(1) == Some("Affinity") {
            affinities.push(Affinity::Numa);
            j += 2;
        } else if words[j] == "GPU" && next(1) == Some("NUMA") && next(2) == Some("ID") {
            affinities.push(Affinity::GpuNuma);
            j += 3;
        } else if !affinities.is_empty() {
            return Err(err(
                Some(header_line),
                ParseErrorKind::UnknownColumn {
                    name: words[j..].join(" "),
                },
            ));
        } else {
            columns.push(match gpu_label(words[j]) {
                Some(i) => Column::Gpu(i),
                None => Column::Other(words[j].to_string()),
            });
            j += 1;
        }
    }
    let gpu_columns: Vec<(usize, usize)> = columns
        .iter()
        .enumerate()
        .filter_map(|(pos, c)| match c {
            Column::Gpu(i) => Some((pos, *i)),
            Column::Other(_) => None,
        })
        .collect();
    let n = gpu_columns.len();
    let mut column_of = vec![usize::MAX; n];
    for &(pos, i) in &gpu_columns {
        if i >= n || column_of[i] != usize::MAX {
            return Err(err(
                Some(header_line),
                ParseErrorKind::GpuColumns {
                    columns: gpu_columns.iter().map(|(_, i)| format!("GPU{i}")).collect(),
                },
            ));
        }
        column_of[i] = pos;
    }

    // Rows, up to the legend.
    let mut rows: Vec<Option<Row>> = (0..n).map(|_| None).collect();
    for (line_no, line) in rest {
        let line_no = *line_no;
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(label) = fields.first() else {
            continue;
        };
        if label.starts_with("Legend") {
            break;
        }
        let gpu = match gpu_label(label) {
            Some(i) if i < n => i,
            _ => {
                if columns.iter().any(|c| c.name() == *label) {
                    continue; // a NIC's (or other device's) row
                }
                return Err(err(
                    Some(line_no),
                    ParseErrorKind::UnknownRow {
                        label: label.to_string(),
                    },
                ));
            }
        };
        if rows[gpu].is_some() {
            return Err(err(Some(line_no), ParseErrorKind::DuplicateRow { gpu }));
        }
        let values = &fields[1..];
        if values.len() < columns.len() {
            return Err(err(
                Some(line_no),
                ParseErrorKind::ShortRow {
                    gpu,
                    expected: columns.len(),
                    found: values.len(),
                },
            ));
        }
        if values.len() > columns.len() + affinities.len() {
            return Err(err(
                Some(line_no),
                ParseErrorKind::LongRow {
                    gpu,
                    expected: columns.len() + affinities.len(),
                    found: values.len(),
                },
            ));
        }
        let mut cells = vec![Cell::X; n];
        for (pos, column) in columns.iter().enumerate() {
            let text = values[pos];
            let cell = Cell::parse(text).ok_or_else(|| {
                err(
                    Some(line_no),
                    ParseErrorKind::BadCell {
                        gpu,
                        column: column.name(),
                        cell: text.to_string(),
                    },
                )
            })?;
            if let Column::Gpu(peer) = column {
                cells[*peer] = cell;
            }
        }
        let (mut cpu_affinity, mut numa) = (None, None);
        for (kind, value) in affinities.iter().zip(&values[columns.len()..]) {
            let known = *value != "N/A";
            match kind {
                Affinity::Cpu if known => cpu_affinity = Some(value.to_string()),
                Affinity::Numa if known => {
                    numa = parse_numa(value).ok_or_else(|| {
                        err(
                            Some(line_no),
                            ParseErrorKind::BadNuma {
                                gpu,
                                value: value.to_string(),
                            },
                        )
                    })?;
                }
                _ => {}
            }
        }
        rows[gpu] = Some(Row {
            line: line_no,
            cells,
            cpu_affinity,
            numa,
        });
    }

    let mut full: Vec<Row> = Vec::with_capacity(n);
    for (gpu, row) in rows.into_iter().enumerate() {
        full.push(row.ok_or(err(None, ParseErrorKind::MissingRow { gpu }))?);
    }
    for (a, row) in full.iter().enumerate() {
        for (b, cell) in row.cells.iter().enumerate() {
            let show = |c: &Cell| match c {
                Cell::X => "X".to_string(),
                Cell::Nv(k) => format!("NV{k}"),
                Cell::Pcie(l) => l.legend().to_string(),
            };
            if a == b {
                if *cell != Cell::X {
                    return Err(err(
                        Some(row.line),
                        ParseErrorKind::NotSelf {
                            gpu: a,
                            cell: show(cell),
                        },
                    ));
                }
            } else if *cell == Cell::X {
                return Err(err(Some(row.line), ParseErrorKind::SelfElsewhere { a, b }));
            } else if *cell != full[b].cells[a] {
                return Err(err(
                    Some(row.line),
                    ParseErrorKind::Asymmetric {
                        a,
                        b,
                        ab: show(cell),
                        ba: show(&full[b].cells[a]),
                    },
                ));
            }
        }
    }

    // NVLink counts beyond what one GPU can have: the links go to NVSwitches.
    let switched: Vec<bool> = full
        .iter()
        .map(|r| {
            let total: u32 = r
                .cells
                .iter()
                .map(|c| match c {
                    Cell::Nv(k) => *k,
                    _ => 0,
                })
                .fold(0u32, u32::saturating_add);
            total > MAX_NVLINKS_PER_GPU
        })
        .collect();
    let links: Vec<Vec<Link>> = (0..n)
        .map(|a| {
            (0..n)
                .map(|b| match full[a].cells[b] {
                    Cell::X => Topology::SELF_LINK,
                    Cell::Nv(k) => Link::nvlink(k, None, switched[a] || switched[b]),
                    Cell::Pcie(level) => Link::pcie(level),
                })
                .collect()
        })
        .collect();
    let gpus: Vec<Gpu> = full
        .into_iter()
        .enumerate()
        .map(|(i, r)| Gpu {
            numa_node: r.numa,
            cpu_affinity: r.cpu_affinity,
            ..Gpu::new(i)
        })
        .collect();
    Topology::new(gpus, links, DEFAULT_PCIE_LINK_GBPS)
        .map_err(|e| err(None, ParseErrorKind::Invalid(e.to_string())))
}

/// A NUMA affinity value: one node, or `None` for a set of several (`0-1`, `0,1`). `Err`-like
/// `None` from the outer Option for anything else.
fn parse_numa(value: &str) -> Option<Option<u32>> {
    if let Ok(node) = value.parse::<u32>() {
        return Some(Some(node));
    }
    let several = value
        .split([',', '-'])
        .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    several.then_some(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells() {
        assert_eq!(Cell::parse("NV12"), Some(Cell::Nv(12)));
        assert_eq!(Cell::parse("SOC"), Some(Cell::Pcie(PcieLevel::System)));
        assert_eq!(Cell::parse("NV0"), None);
        assert_eq!(Cell::parse("NV"), None);
        assert_eq!(Cell::parse("NV+1"), None);
        assert_eq!(Cell::parse("nv2"), None);
        assert_eq!(Cell::parse("CPU"), None);
    }

    #[test]
    fn ansi_underline_and_crlf() {
        let text = "\t\u{1b}[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\u{1b}[0m\r\nGPU0\t X \tNV4\t0-31\t0\t\tN/A\r\nGPU1\tNV4\t X \t0-31\t0\t\tN/A\r\n";
        let t = parse_topo_matrix(text).unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t.link(0, 1).unwrap().nvlink.unwrap().links, 4);
        assert_eq!(t.gpus()[1].numa_node, Some(0));
        assert_eq!(t.gpus()[1].cpu_affinity.as_deref(), Some("0-31"));
    }

    #[test]
    fn numa_values() {
        assert_eq!(parse_numa("3"), Some(Some(3)));
        assert_eq!(parse_numa("0-1"), Some(None));
        assert_eq!(parse_numa("0,2"), Some(None));
        assert_eq!(parse_numa("zero"), None);
        assert_eq!(parse_numa("1-"), None);
    }
}
