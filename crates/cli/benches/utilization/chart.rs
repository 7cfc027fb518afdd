//! The chart: grouped bars per kind x mode (measured, filled) with the seeds' figures beside
//! them (outlined), as an SVG.

use super::placement::Mode;

/// The seeds' chart: GPU utilization %, per kind, in mode order (exclusive, basic sharing,
/// topology-optimized sharing).
pub const SEEDS: [(&str, [f64; 3]); 3] = [
    ("vision", [22.0, 58.0, 89.0]),
    ("nlp", [18.0, 63.0, 91.0]),
    ("scientific", [25.0, 52.0, 84.0]),
];

const COLORS: [&str; 3] = ["#8c8c8c", "#e08a2c", "#2a8a5a"];

/// `measured[kind][mode]`: utilization % (kinds in [`SEEDS`] order). `title`: the first line.
pub fn svg(title: &str, subtitle: &str, measured: &[[f64; 3]; 3]) -> String {
    let (w, h) = (820.0, 420.0);
    let (x0, y0, plot_h) = (60.0, 360.0, 280.0);
    let y = |v: f64| y0 - plot_h * v.clamp(0.0, 100.0) / 100.0;
    let mut out = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"##
    );
    out.push_str(&format!(
        r##"<rect width="{w}" height="{h}" fill="white"/><text x="20" y="24" font-size="15">{title}</text><text x="20" y="44" fill="#555">{subtitle}</text>"##
    ));
    for v in [0, 25, 50, 75, 100] {
        let yy = y(v as f64);
        out.push_str(&format!(
            r##"<line x1="{x0}" y1="{yy}" x2="{}" y2="{yy}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{v}%</text>"##,
            w - 20.0,
            x0 - 6.0,
            yy + 4.0
        ));
    }
    let group_w = (w - x0 - 20.0) / 3.0;
    let bar = 26.0;
    for (k, (kind, seeds)) in SEEDS.iter().enumerate() {
        let gx = x0 + k as f64 * group_w + 20.0;
        for (m, mode) in Mode::ALL.iter().enumerate() {
            let x = gx + m as f64 * (2.0 * bar + 12.0);
            let (v, s) = (measured[k][m], seeds[m]);
            let c = COLORS[m];
            out.push_str(&format!(
                r##"<rect x="{x}" y="{}" width="{bar}" height="{}" fill="{c}"><title>{kind}, {}: measured {v:.1} %</title></rect>"##,
                y(v),
                y0 - y(v),
                mode.label()
            ));
            out.push_str(&format!(
                r##"<text x="{}" y="{}" text-anchor="middle" font-size="11">{v:.0}</text>"##,
                x + bar / 2.0,
                y(v) - 4.0
            ));
            let xs = x + bar + 2.0;
            out.push_str(&format!(
                r##"<rect x="{xs}" y="{}" width="{}" height="{}" fill="none" stroke="{c}" stroke-width="2" stroke-dasharray="4 2"><title>{kind}, {}: the seeds' {s:.0} %</title></rect>"##,
                y(s),
                bar - 2.0,
                y0 - y(s),
                mode.label()
            ));
            out.push_str(&format!(
                r##"<text x="{}" y="{}" text-anchor="middle" font-size="11" fill="#555">{s:.0}</text>"##,
                xs + bar / 2.0 - 1.0,
                y(s) - 4.0
            ));
        }
        out.push_str(&format!(
            r##"<text x="{}" y="{}" text-anchor="middle" font-size="13">{kind}</text>"##,
            gx + 1.5 * (2.0 * bar + 12.0) - 6.0,
            y0 + 20.0
        ));
    }
    let ly = y0 + 42.0;
    let mut lx = x0;
    for (m, mode) in Mode::ALL.iter().enumerate() {
        out.push_str(&format!(
            r##"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"##,
            ly - 10.0,
            COLORS[m],
            lx + 16.0,
            ly,
            mode.label()
        ));
        lx += 200.0;
    }
    out.push_str(&format!(
        r##"<rect x="{lx}" y="{}" width="12" height="12" fill="none" stroke="#555" stroke-dasharray="4 2"/><text x="{}" y="{ly}">the seeds' figure</text>"##,
        ly - 10.0,
        lx + 16.0
    ));
    out.push_str("</svg>\n");
    out
}
