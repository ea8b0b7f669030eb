//! `--plot`: an SVG of a sweep, drawn with `plotters` (its SVG backend writes text as SVG
//! `<text>`, so no system font is needed): p50 latency (left) and algorithm bandwidth (right)
//! against tokens per attention rank, both axes logarithmic. One colour per operation: xccl
//! solid with points, the streaming limit of the same bytes dashed, the MPI baseline (when
//! given) dotted with crosses.

use std::path::Path;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::{ResultRow, OPS};

const W: u32 = 1200;
const H: u32 = 520;
const COLORS: [RGBColor; 3] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
];

/// Which figure of a row a panel shows.
#[derive(Clone, Copy)]
enum Panel {
    Latency,
    Bandwidth,
}

impl Panel {
    fn title(self) -> &'static str {
        match self {
            Panel::Latency => "p50 latency (us)",
            Panel::Bandwidth => "algbw (GB/s)",
        }
    }

    /// (xccl, limit, mpi) values of a row in this panel's unit.
    fn values(self, r: &ResultRow) -> (f64, Option<f64>, Option<f64>) {
        let bw = |us: f64| r.bytes_per_rank as f64 / (us * 1e3);
        match self {
            Panel::Latency => (r.p50_us, r.limit_us, r.mpi_us),
            Panel::Bandwidth => (
                r.algbw_gbps,
                r.limit_us.filter(|&l| l > 0.0).map(bw),
                r.mpi_us.filter(|&m| m > 0.0).map(bw),
            ),
        }
    }
}

type Series = Vec<(f64, f64)>;

/// Per op: xccl, limit and MPI points of `panel`, positive values only (log axes).
fn series(rows: &[ResultRow], panel: Panel) -> Vec<(&'static str, Series, Series, Series)> {
    OPS.iter()
        .map(|&op| {
            let mut mine: Vec<&ResultRow> = rows.iter().filter(|r| r.op == op).collect();
            mine.sort_by_key(|r| r.tokens);
            let (mut x, mut l, mut m) = (Vec::new(), Vec::new(), Vec::new());
            for r in mine {
                let t = r.tokens as f64;
                let (v, lim, mpi) = panel.values(r);
                if v > 0.0 {
                    x.push((t, v));
                }
                if let Some(v) = lim.filter(|&v| v > 0.0) {
                    l.push((t, v));
                }
                if let Some(v) = mpi.filter(|&v| v > 0.0) {
                    m.push((t, v));
                }
            }
            (op, x, l, m)
        })
        .collect()
}

/// A log range around `lo..hi` with some margin, never empty.
fn log_range(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let (lo, hi) = if lo.is_finite() && hi.is_finite() && lo > 0.0 {
        (lo, hi.max(lo))
    } else {
        (1.0, 10.0)
    };
    (lo / 1.6)..(hi * 1.6)
}

fn draw_panel(
    area: &DrawingArea<SVGBackend, Shift>,
    rows: &[ResultRow],
    panel: Panel,
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<_>| e.to_string();
    let data = series(rows, panel);
    let tokens: Vec<f64> = rows.iter().map(|r| r.tokens as f64).collect();
    let (tmin, tmax) = tokens
        .iter()
        .fold((f64::INFINITY, 0.0f64), |(a, b), &t| (a.min(t), b.max(t)));
    let values = data
        .iter()
        .flat_map(|(_, x, l, m)| x.iter().chain(l).chain(m).map(|p| p.1));
    let (vmin, vmax) = values.fold((f64::INFINITY, 0.0f64), |(a, b), v| (a.min(v), b.max(v)));
    let mut chart = ChartBuilder::on(area)
        .caption(panel.title(), ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(
            log_range(tmin, tmax).log_scale(),
            log_range(vmin, vmax).log_scale(),
        )
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("tokens per attention rank")
        .y_desc(panel.title())
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| {
            if *v >= 100.0 {
                format!("{v:.0}")
            } else if *v >= 1.0 {
                format!("{v:.1}")
            } else {
                format!("{v:.3}")
            }
        })
        .label_style(("sans-serif", 14))
        .light_line_style(RGBColor(238, 238, 238))
        .draw()
        .map_err(e)?;
    for (i, (op, xccl, limit, mpi)) in data.into_iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(xccl.clone(), c.stroke_width(3)))
            .map_err(e)?
            .label(format!("xccl {op}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3)));
        chart
            .draw_series(xccl.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(e)?;
        if !limit.is_empty() {
            chart
                .draw_series(DashedLineSeries::new(limit, 8, 5, c.stroke_width(2)))
                .map_err(e)?
                .label(format!("limit {op}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 8, y)], c.stroke_width(2))
                });
        }
        if !mpi.is_empty() {
            chart
                .draw_series(DashedLineSeries::new(mpi.clone(), 2, 4, c.stroke_width(2)))
                .map_err(e)?
                .label(format!("MPI {op}"))
                .legend(move |(x, y)| Cross::new((x + 12, y), 5, c.stroke_width(2)));
            chart
                .draw_series(mpi.iter().map(|&p| Cross::new(p, 5, c.stroke_width(2))))
                .map_err(e)?;
        }
    }
    // One legend, in the latency panel's upper left (latency grows with tokens, so that corner
    // stays empty); the bandwidth panel uses the same colours and dashes.
    if let Panel::Latency = panel {
        legend_upper_left(&mut chart)?;
    }
    Ok(())
}

/// Draws the chart's legend in its upper left corner, on a translucent white box.
pub fn legend_upper_left<'a, DB, CT>(chart: &mut ChartContext<'a, DB, CT>) -> Result<(), String>
where
    DB: DrawingBackend + 'a,
    CT: CoordTranslate,
{
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 13))
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())
}

/// Renders the sweep as SVG text.
pub fn render(rows: &[ResultRow], title: &str) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (W, H)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        let root = root.titled(title, ("sans-serif", 22)).map_err(e)?;
        let (left, right) = root.split_horizontally(W / 2);
        draw_panel(&left, rows, Panel::Latency)?;
        draw_panel(&right, rows, Panel::Bandwidth)?;
        root.present().map_err(e)?;
    }
    Ok(svg)
}

/// Writes the SVG of the sweep to `path`.
pub fn write(path: &Path, rows: &[ResultRow], title: &str) -> Result<(), String> {
    let svg = render(rows, title)?;
    std::fs::write(path, svg).map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(op: &'static str, tokens: usize, p50: f64) -> ResultRow {
        ResultRow {
            op,
            quant: "none",
            wire_bytes_per_token: 14336,
            tokens,
            p50_us: p50,
            p99_us: p50 * 1.5,
            bytes_per_rank: tokens as u64 * 14336,
            algbw_gbps: tokens as f64 * 14336.0 / (p50 * 1e3),
            memcpy_gbps: 10.0,
            metadata_records: 1,
            limit_us: Some(p50 * 0.8),
            mpi_us: (tokens > 1).then_some(p50 * 3.0),
        }
    }

    #[test]
    fn svg_has_both_panels_every_series_and_readable_labels() {
        let rows: Vec<ResultRow> = OPS
            .iter()
            .flat_map(|&op| [1, 32, 512].map(|t| row(op, t, 2.0 + t as f64 * 3.0)))
            .collect();
        let svg = render(&rows, "xccl-bench test P50").unwrap();
        assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(80)]);
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            "p50 latency (us)",
            "algbw (GB/s)",
            "xccl roundtrip",
            "limit a2e",
            "MPI e2a",
            "tokens per attention rank",
            "xccl-bench test P50",
        ] {
            assert!(svg.contains(text), "missing {text:?}");
        }
    }

    #[test]
    fn a_single_point_without_limit_or_mpi_still_renders() {
        let mut r = row("a2e", 128, 100.0);
        r.limit_us = None;
        r.mpi_us = None;
        let svg = render(&[r], "one point").unwrap();
        assert!(svg.contains("xccl a2e") && !svg.contains("limit a2e"));
    }
}
