//! `xccl-bench model`: the cost model ([`crate::model`]) put to use. First the calibration:
//! its parameters fitted to measured `--stats --json` runs (direct ones; relayed runs are held
//! out as a check), each prediction beside its measurement with the error. Then the
//! projection: the decode shape's A2E and E2A traffic counted by running the protocol on the
//! local fabric at a small hidden size (rescaled exactly to the real one, see
//! [`crate::model::Counts::rescaled`]), priced with the given fabric parameters, direct and
//! through relays, for each M, beside xDeepServe's published figures; optionally an SVG plot
//! and JSON.

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use serde_json::json;

use crate::cli::ModelArgs;
use crate::model::{calibrate, counted, predict, samples_from_report, FabricParams, Sample, Shape};

/// xDeepServe's published disaggregated decode figures (arXiv 2508.02520): A2E and E2A, us.
pub const PAPER_A2E_US: f64 = 172.0;
/// See [`PAPER_A2E_US`].
pub const PAPER_E2A_US: f64 = 193.0;
/// The M the paper's figures are for (attention dies per DP domain).
pub const PAPER_M: usize = 160;

/// Hidden size the projection's counting run uses (a multiple of 16, as the real one must be,
/// so every row grows by exactly the same bytes; see [`crate::model::Shape::row_deltas`]).
pub const COUNT_HIDDEN: usize = 16;

/// One projected point.
#[derive(Clone, Debug)]
pub struct Projected {
    /// Attention ranks.
    pub attention: usize,
    /// Relays (`None`: direct).
    pub relays: Option<usize>,
    /// The path: `direct` or the relay choice (`R=M/10`, `R=M`, `R=16`).
    pub path: String,
    /// Records per A2E, counted.
    pub records: f64,
    /// Largest bytes one rank put into other ranks' windows in the A2E, at the real H.
    pub max_a2e_out: f64,
    /// Predicted A2E, us.
    pub a2e_us: f64,
    /// Predicted E2A, us.
    pub e2a_us: f64,
}

/// Calibration of the model against `files`: the fitted parameters and the samples (one per
/// point: the median p50 of the files that measured it).
fn calibration(files: &[std::path::PathBuf]) -> Result<(FabricParams, Vec<Sample>), String> {
    let mut samples = Vec::new();
    let mut cores = 1.0f64;
    for f in files {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let doc: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", f.display()))?;
        let (s, c) = samples_from_report(&doc).map_err(|e| format!("{}: {e}", f.display()))?;
        samples.extend(s);
        cores = c;
    }
    // Repeated runs of one point: the median of their p50s (counts are the first run's; the
    // routing is the same, so they are too).
    let mut merged: Vec<(Sample, Vec<f64>)> = Vec::new();
    for smp in samples {
        match merged.iter_mut().find(|(m, _)| m.label == smp.label) {
            Some((_, v)) => v.push(smp.measured_us),
            None => {
                let v = vec![smp.measured_us];
                merged.push((smp, v));
            }
        }
    }
    let samples: Vec<Sample> = merged
        .into_iter()
        .map(|(mut smp, v)| {
            if v.len() > 1 {
                smp.label = format!("{} (n={})", smp.label, v.len());
            }
            smp.measured_us = median(v);
            smp
        })
        .collect();
    let start = FabricParams {
        latency_us: 1.0,
        link_gbps: 5.0,
        copy_gbps: 10.0,
        record_us: 0.1,
        cores: Some(cores),
    };
    let fit_on: Vec<Sample> = samples
        .iter()
        .filter(|s| !s.counts.relayed)
        .cloned()
        .collect();
    let fitted = calibrate(&start, if fit_on.is_empty() { &samples } else { &fit_on });
    Ok((fitted, samples))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn params_line(p: &FabricParams) -> String {
    format!(
        "latency {:.2} us/hop, link {:.2} GB/s, copy {:.2} GB/s, record {:.3} us{}",
        p.latency_us,
        p.link_gbps,
        p.copy_gbps,
        p.record_us,
        p.cores
            .map_or(String::new(), |c| format!(", ranks share {c} cores"))
    )
}

/// Projects every M of `a`, direct and relayed.
pub fn project(a: &ModelArgs, p: &FabricParams) -> Result<Vec<Projected>, String> {
    if !a.hidden.is_multiple_of(16) || a.hidden < COUNT_HIDDEN {
        return Err(format!(
            "--hidden {} must be a multiple of 16 (the counting run's rows grow by the same \
             bytes then)",
            a.hidden
        ));
    }
    let mut out = Vec::new();
    for &m in &a.attention {
        let paths = std::iter::once(None).chain(a.relays.iter().map(|&c| Some(c)));
        for choice in paths {
            let relays = choice.map(|c| c.count(m, a.experts));
            let shape = Shape {
                attention: m,
                experts: a.experts,
                routed: a.routed,
                topk: a.topk,
                tokens: a.tokens,
                relays,
            };
            let topo = shape.topology().map_err(|e| e.to_string())?;
            let (d_a2e, d_e2a) = shape.row_deltas(&topo, COUNT_HIDDEN, a.hidden);
            let (a2e, e2a) = counted(&shape, COUNT_HIDDEN, 1)?;
            let (a2e, e2a) = (a2e.rescaled(d_a2e), e2a.rescaled(d_e2a));
            let max_out = a2e
                .ranks
                .iter()
                .enumerate()
                .map(|(r, rc)| {
                    rc.links
                        .iter()
                        .filter(|l| l.to != r)
                        .map(|l| l.bytes)
                        .sum::<f64>()
                })
                .fold(0.0, f64::max);
            out.push(Projected {
                attention: m,
                relays,
                path: choice.map_or("direct".into(), |c| c.label()),
                records: a2e.records(),
                max_a2e_out: max_out,
                a2e_us: predict(p, &a2e).total_us,
                e2a_us: predict(p, &e2a).total_us,
            });
        }
    }
    Ok(out)
}

/// Runs `xccl-bench model`; returns the text to print.
pub fn run(a: &ModelArgs) -> Result<String, String> {
    let mut s = String::new();
    let mut doc = json!({});
    if !a.calibrate.is_empty() {
        let (fit, samples) = calibration(&a.calibrate)?;
        let _ = writeln!(
            s,
            "# calibration: fitted to the direct runs ({}); relayed runs are a check",
            params_line(&fit)
        );
        let _ = writeln!(
            s,
            "# {:<34} {:>6} {:>12} {:>12} {:>8}",
            "run point", "use", "measured_us", "model_us", "error"
        );
        let mut errs = (Vec::new(), Vec::new());
        let mut rows = Vec::new();
        for smp in &samples {
            let pred = predict(&fit, &smp.counts).total_us;
            let err = pred / smp.measured_us - 1.0;
            let used = !smp.counts.relayed;
            if used {
                errs.0.push(err.abs());
            } else {
                errs.1.push(err.abs());
            }
            let _ = writeln!(
                s,
                "  {:<34} {:>6} {:>12.1} {:>12.1} {:>+7.0}%",
                smp.label,
                if used { "fit" } else { "check" },
                smp.measured_us,
                pred,
                err * 100.0
            );
            rows.push(
                json!({"point": smp.label, "fit": used, "measured_us": smp.measured_us,
                             "model_us": pred, "error": err}),
            );
        }
        let _ = writeln!(
            s,
            "# median |error|: fit {:.0}% over {} points, check {:.0}% over {} points",
            median(errs.0.clone()) * 100.0,
            errs.0.len(),
            median(errs.1.clone()) * 100.0,
            errs.1.len()
        );
        doc["calibration"] = json!({
            "latency_us": fit.latency_us, "link_gbps": fit.link_gbps,
            "copy_gbps": fit.copy_gbps, "record_us": fit.record_us, "cores": fit.cores,
            "points": rows,
        });
    }
    let p = FabricParams {
        latency_us: a.latency_us,
        link_gbps: a.link_gbps,
        copy_gbps: a.copy_gbps,
        record_us: a.record_us,
        cores: None,
    };
    let proj = project(a, &p)?;
    let _ = writeln!(
        s,
        "# projection: {} expert ranks ({} routed + shared-expert replicas), top-{} + shared, \
         T={} per attention rank, H={}, INT8 A2E, bf16 E2A; {}",
        a.experts,
        a.routed,
        a.topk,
        a.tokens,
        a.hidden,
        params_line(&p)
    );
    let _ = writeln!(
        s,
        "# traffic counted by running each shape on the local fabric at H={COUNT_HIDDEN}, \
         rescaled to H={}",
        a.hidden
    );
    let _ = writeln!(
        s,
        "# {:>5} {:>8} {:>6} {:>12} {:>14} {:>10} {:>10} {:>10} {:>10}",
        "M",
        "path",
        "relays",
        "a2e_records",
        "max_out_MB",
        "a2e_us",
        "e2a_us",
        "paper_a2e",
        "paper_e2a"
    );
    for r in &proj {
        let paper = |v: f64| {
            if r.attention == PAPER_M {
                format!("{v:.0}")
            } else {
                "-".into()
            }
        };
        let _ = writeln!(
            s,
            "  {:>5} {:>8} {:>6} {:>12.0} {:>14.2} {:>10.1} {:>10.1} {:>10} {:>10}",
            r.attention,
            r.path,
            r.relays.map_or("-".into(), |k| k.to_string()),
            r.records,
            r.max_a2e_out / 1e6,
            r.a2e_us,
            r.e2a_us,
            paper(PAPER_A2E_US),
            paper(PAPER_E2A_US)
        );
    }
    doc["projection"] = json!({
        "params": {"latency_us": p.latency_us, "link_gbps": p.link_gbps,
                   "copy_gbps": p.copy_gbps, "record_us": p.record_us},
        "shape": {"experts": a.experts, "routed": a.routed, "topk": a.topk,
                  "tokens": a.tokens, "hidden": a.hidden},
        "paper": {"attention": PAPER_M, "a2e_us": PAPER_A2E_US, "e2a_us": PAPER_E2A_US},
        "points": proj.iter().map(|r| json!({
            "attention": r.attention, "path": r.path, "relays": r.relays, "a2e_records": r.records,
            "max_a2e_out_bytes": r.max_a2e_out, "a2e_us": r.a2e_us, "e2a_us": r.e2a_us,
        })).collect::<Vec<_>>(),
    });
    if let Some(path) = &a.plot {
        let title = format!(
            "xccl cost model: {}E, T={}, H={}, link {} GB/s, {} us/hop, {} us/record",
            a.experts, a.tokens, a.hidden, p.link_gbps, p.latency_us, p.record_us
        );
        write_plot(path, &proj, &title)?;
    }
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?;
        std::fs::write(path, text + "\n")
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(s)
}

/// A projected time of a point.
type Getter = fn(&Projected) -> f64;

/// Renders projected A2E and E2A time against M, direct (solid) and relayed (dashed), with the
/// paper's figures as crosses at M = 160.
pub fn render_plot(proj: &[Projected], title: &str) -> Result<String, String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 520)).into_drawing_area();
        let e = |e: DrawingAreaErrorKind<_>| e.to_string();
        root.fill(&WHITE).map_err(e)?;
        let xmax = proj
            .iter()
            .map(|r| r.attention)
            .max()
            .unwrap_or(1)
            .max(PAPER_M) as f64;
        let ymax = proj
            .iter()
            .flat_map(|r| [r.a2e_us, r.e2a_us])
            .fold(PAPER_E2A_US, f64::max);
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(14)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..xmax * 1.05, 0.0..ymax * 1.15)
            .map_err(e)?;
        chart
            .configure_mesh()
            .x_desc("attention ranks M")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.0}"))
            .y_desc("projected time (us)")
            .label_style(("sans-serif", 14))
            .light_line_style(RGBColor(238, 238, 238))
            .draw()
            .map_err(e)?;
        let colors = [RGBColor(31, 119, 180), RGBColor(214, 39, 40)];
        let mut paths: Vec<&str> = Vec::new();
        for r in proj {
            if !paths.contains(&r.path.as_str()) {
                paths.push(&r.path);
            }
        }
        let ops: [(&str, Getter, f64); 2] = [
            ("A2E", |r| r.a2e_us, PAPER_A2E_US),
            ("E2A", |r| r.e2a_us, PAPER_E2A_US),
        ];
        for (i, (op, get, paper)) in ops.into_iter().enumerate() {
            let c = colors[i];
            for (j, path) in paths.iter().enumerate() {
                let line: Vec<(f64, f64)> = proj
                    .iter()
                    .filter(|r| r.path == *path)
                    .map(|r| (r.attention as f64, get(r)))
                    .collect();
                // Direct solid; each relay choice dashed, shorter dashes for the next.
                let label = if j == 0 {
                    format!("{op} {path}")
                } else {
                    format!("{op} relayed {path}")
                };
                // The legend's sample: solid, or as many dashes as the line has per 24 px.
                let pieces = if j == 0 { 1 } else { 2 + j as i32 % 3 };
                let legend = move |(x, y): (i32, i32)| {
                    let w = 24 / pieces;
                    let gap = 3 * i32::from(pieces > 1);
                    // Dash k of the sample, or nothing past the last.
                    let dash = |k: i32| {
                        let (a, b) = if k < pieces {
                            (k * w, k * w + w - gap)
                        } else {
                            (0, 0)
                        };
                        PathElement::new(vec![(a, 0), (b, 0)], c.stroke_width(2))
                    };
                    EmptyElement::at((x, y)) + dash(0) + dash(1) + dash(2) + dash(3)
                };
                if j == 0 {
                    chart
                        .draw_series(LineSeries::new(line.clone(), c.stroke_width(3)))
                        .map_err(e)?
                        .label(label)
                        .legend(legend);
                } else {
                    let dash = (24 / pieces - 3) as u32;
                    chart
                        .draw_series(DashedLineSeries::new(
                            line.clone(),
                            dash,
                            5,
                            c.stroke_width(2),
                        ))
                        .map_err(e)?
                        .label(label)
                        .legend(legend);
                }
                chart
                    .draw_series(line.iter().map(|&p| Circle::new(p, 3, c.filled())))
                    .map_err(e)?;
            }
            chart
                .draw_series([Cross::new((PAPER_M as f64, paper), 7, c.stroke_width(3))])
                .map_err(e)?
                .label(format!("{op} xDeepServe (paper)"))
                .legend(move |(x, y)| Cross::new((x + 12, y), 5, c.stroke_width(2)));
        }
        crate::plot::legend_upper_left(&mut chart)?;
        root.present().map_err(e)?;
    }
    Ok(svg)
}

fn write_plot(path: &Path, proj: &[Projected], title: &str) -> Result<(), String> {
    let svg = render_plot(proj, title)?;
    std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> ModelArgs {
        #[derive(Parser)]
        struct P {
            #[command(flatten)]
            m: ModelArgs,
        }
        P::parse_from(std::iter::once("model").chain(extra.iter().copied())).m
    }

    #[test]
    fn relays_cut_the_records_and_the_projection_plots_both_paths() {
        let a = args(&[
            "-a", "4,8", "-e", "12", "--routed", "8", "-k", "2", "-t", "4", "--hidden", "256",
            "--relays", "2,m",
        ]);
        let p = FabricParams {
            latency_us: 1.5,
            link_gbps: 196.0,
            copy_gbps: 400.0,
            record_us: 0.1,
            cores: None,
        };
        let proj = project(&a, &p).unwrap();
        assert_eq!(proj.len(), 6, "2 values of M x (direct, R=2, R=M)");
        let (direct, relayed, per_attention) = (&proj[3], &proj[4], &proj[5]);
        assert_eq!(per_attention.relays, Some(8));
        assert_eq!((direct.attention, direct.relays), (8, None));
        assert_eq!(direct.records, (8 * 12) as f64, "M x N records direct");
        assert_eq!(
            relayed.records,
            (8 + 2 * 12) as f64,
            "M + R x N through relays"
        );
        assert!(direct.a2e_us > 1.5 && relayed.a2e_us > 3.0, "{proj:?}");
        let svg = render_plot(&proj, "test").unwrap();
        for label in [
            "A2E direct",
            "E2A relayed R=2",
            "A2E relayed R=M",
            "xDeepServe (paper)",
        ] {
            assert!(svg.contains(label), "plot lacks {label}");
        }
        assert!(project(&args(&["--hidden", "100"]), &p).is_err());
    }
}
