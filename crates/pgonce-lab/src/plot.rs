//! `pgonce bench ... --plot FILE.svg`: a run's figures as one SVG, drawn
//! with plotters (SVG backend only): throughput per strategy, latency
//! percentiles, each ratio with its goal where the suite states one, and
//! the goals in milliseconds beside what the run measured.
//!
//! Honest by construction: every value axis starts at zero, units are
//! named on the axes, and the caption describes the machine (CPUs, load
//! average when the plot was drawn, PostgreSQL version, fsync and
//! synchronous_commit) so a figure is never read without its conditions.

use std::path::Path;

use anyhow::Context;
use plotters::coord::ranged1d::{IntoSegmentedCoord, SegmentValue};
use plotters::prelude::*;

use crate::report::{Bound, Report};

const WIDTH: u32 = 1000;
const BAR_HEIGHT: u32 = 20;
const PANEL_MARGIN: u32 = 90;

/// One bar: a label and its values (one per series).
struct Bar {
    label: String,
    values: Vec<f64>,
}

/// Writes the report's plot to `path`.
pub(crate) fn write(report: &Report, path: &Path) -> anyhow::Result<()> {
    let svg = svg(report, &machine(report))?;
    std::fs::write(path, svg).with_context(|| format!("writing the plot to {}", path.display()))
}

/// The machine, as the caption says it.
fn machine(report: &Report) -> String {
    let e = &report.environment;
    let load = |l: Option<f64>| l.map_or_else(|| "unknown".into(), |l| format!("{l:.2}"));
    format!(
        "{} CPUs, PostgreSQL {} ({} server), fsync {}, synchronous_commit {}, pgonce {} ({} build)\n\
         Load average (1 min): {} when the run began, {} when it ended (the end counts the run's own clients and server)",
        e.cpus,
        e.postgres_version,
        e.server,
        if e.fsync { "on" } else { "off" },
        e.synchronous_commit,
        e.pgonce_version,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        },
        load(e.load_at_start),
        load(crate::report::load_average()),
    )
}

/// The plot as an SVG document, `machine` (one or more lines) in its
/// caption.
pub(crate) fn svg(report: &Report, machine: &str) -> anyhow::Result<String> {
    // Suites run with --repeat have a row per strategy and run.
    let repeated = report
        .results
        .iter()
        .any(|r| r.number("run").is_some_and(|n| n > 1.0));
    let label = |r: &crate::report::Row| {
        let mut l = r.text("strategy").unwrap_or_default();
        if let Some(o) = r.text("overlap") {
            l = format!("{l} / {o}");
        }
        for k in ["scopes", "declarers", "window", "latency_ms", "shape"] {
            if let Some(v) = r.text(k) {
                l = format!("{l} {k}={v}");
            }
        }
        if repeated && let Some(run) = r.text("run") {
            l = format!("{l} run={run}");
        }
        l
    };
    let throughput: Vec<Bar> = report
        .results
        .iter()
        .filter_map(|r| {
            let (name, value) = rate(r)?;
            Some(Bar {
                label: match name.strip_suffix("_per_sec") {
                    Some("ops") | None => label(r),
                    Some(unit) => format!("{} ({unit}/s)", label(r)),
                },
                values: vec![value],
            })
        })
        .collect();
    let latency: Vec<Bar> = report
        .results
        .iter()
        .filter_map(|r| {
            let (prefix, p50, p99) = percentiles(r)?;
            Some(Bar {
                label: if prefix.is_empty() {
                    label(r)
                } else {
                    format!("{} ({})", label(r), prefix.replace('_', " "))
                },
                values: vec![p50, p99],
            })
        })
        .collect();
    let ratios: Vec<(Bar, Option<f64>)> = report
        .ratios
        .iter()
        .map(|(name, value)| {
            let goal = report
                .goals
                .iter()
                .find(|g| &g.figure == name && g.unit == "x")
                .map(|g| g.target);
            (
                Bar {
                    label: name.clone(),
                    values: vec![*value],
                },
                goal,
            )
        })
        .collect();

    // Goals on figures that are not ratios (a p99 in milliseconds): the
    // measured value, the goal as the red mark.
    let ms_goals: Vec<(Bar, Option<f64>)> = report
        .goals
        .iter()
        .filter(|g| g.unit == "ms")
        .map(|g| {
            let side = match g.bound {
                Bound::AtLeast => "at least",
                Bound::AtMost => "at most",
            };
            (
                Bar {
                    label: format!("{} (goal: {side} {} ms)", g.figure, g.target),
                    values: vec![g.measured.unwrap_or(0.0)],
                },
                Some(g.target),
            )
        })
        .collect();

    let height = |n: usize| n.max(1) as u32 * BAR_HEIGHT + PANEL_MARGIN;
    let heights = [
        height(throughput.len()),
        height(latency.len() * 2),
        height(ratios.len()),
        if ms_goals.is_empty() {
            0
        } else {
            height(ms_goals.len())
        },
    ];
    let caption_height = 40 + 18 * machine.lines().count().max(1) as u32;
    let total = caption_height + heights.iter().sum::<u32>();
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (WIDTH, total)).into_drawing_area();
        root.fill(&WHITE)?;
        let (head, body) = root.split_vertically(caption_height);
        head.draw_text(
            &format!("pgonce {} {}: one run", report.command, report.name),
            &("sans-serif", 20).into_font().color(&BLACK),
            (10, 8),
        )?;
        for (i, line) in machine.lines().enumerate() {
            let line = if i == 0 {
                format!("Machine: {line}")
            } else {
                line.to_owned()
            };
            head.draw_text(
                &line,
                &("sans-serif", 13).into_font().color(&BLACK),
                (10, 36 + 18 * i as i32),
            )?;
        }
        let (top, rest) = body.split_vertically(heights[0]);
        let (middle, rest) = rest.split_vertically(heights[1]);
        let (bottom, last) = rest.split_vertically(heights[2]);
        bars(
            &top,
            "Throughput per strategy",
            "operations per second (messages in bench queue; other units named in the label), axis from zero",
            &throughput,
            &[("ops/s", BLUE)],
            &[],
            None,
        )?;
        bars(
            &middle,
            "Latency percentiles",
            "milliseconds (p50, p99), axis from zero",
            &latency,
            &[("p50", GREEN), ("p99", MAGENTA)],
            &[],
            None,
        )?;
        let goals: Vec<Option<f64>> = ratios.iter().map(|(_, g)| *g).collect();
        let ratio_bars: Vec<Bar> = ratios.into_iter().map(|(b, _)| b).collect();
        bars(
            &bottom,
            "Ratios (red mark: the goal where one is stated; grey line: 1.0)",
            "ratio (x), axis from zero",
            &ratio_bars,
            &[("ratio", CYAN)],
            &goals,
            Some(1.0),
        )?;
        if !ms_goals.is_empty() {
            let goals: Vec<Option<f64>> = ms_goals.iter().map(|(_, g)| *g).collect();
            let goal_bars: Vec<Bar> = ms_goals.into_iter().map(|(b, _)| b).collect();
            bars(
                &last,
                "Goals in milliseconds (red mark: the goal)",
                "milliseconds, axis from zero",
                &goal_bars,
                &[("measured", BLUE)],
                &goals,
                None,
            )?;
        }
        root.present()?;
    }
    Ok(out)
}

/// A row's throughput: `ops_per_sec`, or where a suite names its operation
/// (`jobs_per_sec`, `declarations_per_sec`) the first such figure.
fn rate(row: &crate::report::Row) -> Option<(String, f64)> {
    let name = if row.number("ops_per_sec").is_some() {
        "ops_per_sec"
    } else {
        row.names().find(|n| n.ends_with("_per_sec"))?
    };
    Some((name.to_owned(), row.number(name)?))
}

/// A row's end-to-end latency percentiles: `p50_ms` and `p99_ms`, or where
/// a suite names what it timed (`claim_to_complete_p50_ms`) the first such
/// pair; with that name (empty for the shared figures).
fn percentiles(row: &crate::report::Row) -> Option<(String, f64, f64)> {
    if let (Some(p50), Some(p99)) = (row.number("p50_ms"), row.number("p99_ms")) {
        return Some((String::new(), p50, p99));
    }
    row.names()
        .filter_map(|n| n.strip_suffix("_p50_ms"))
        .find_map(|prefix| {
            let p50 = row.number(&format!("{prefix}_p50_ms"))?;
            let p99 = row.number(&format!("{prefix}_p99_ms"))?;
            Some((prefix.to_owned(), p50, p99))
        })
}

/// Horizontal bars, one row per bar and series, values from zero; a red
/// mark at each bar's goal, and a grey line at `reference` (1.0 on a ratio
/// axis).
fn bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    unit: &str,
    bars: &[Bar],
    series: &[(&str, RGBColor)],
    goals: &[Option<f64>],
    reference: Option<f64>,
) -> anyhow::Result<()>
where
    DB::ErrorType: 'static,
{
    let rows = bars.len() * series.len();
    let max = bars
        .iter()
        .flat_map(|b| b.values.iter().copied())
        .chain(goals.iter().flatten().copied())
        .fold(0.0f64, f64::max);
    let x_max = if max > 0.0 { max * 1.15 } else { 1.0 };
    let labels: Vec<String> = bars
        .iter()
        .flat_map(|b| {
            series.iter().map(move |(s, _)| {
                if series.len() > 1 {
                    format!("{} ({s})", b.label)
                } else {
                    b.label.clone()
                }
            })
        })
        .collect();
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 16))
        .margin(8)
        .x_label_area_size(40)
        .y_label_area_size(380)
        .build_cartesian_2d(0f64..x_max, (0..rows.max(1) as i32).into_segmented())?;
    let label_of = |v: &SegmentValue<i32>| match v {
        SegmentValue::CenterOf(i) => labels.get(*i as usize).cloned().unwrap_or_default(),
        _ => String::new(),
    };
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(rows.max(1))
        .y_label_formatter(&label_of)
        .x_desc(unit)
        .label_style(("sans-serif", 12))
        .draw()?;
    for (i, bar) in bars.iter().enumerate() {
        for (j, (_, color)) in series.iter().enumerate() {
            let row = (i * series.len() + j) as i32;
            let value = bar.values.get(j).copied().unwrap_or(0.0).max(0.0);
            chart.draw_series(std::iter::once(Rectangle::new(
                [
                    (0.0, SegmentValue::Exact(row)),
                    (value, SegmentValue::Exact(row + 1)),
                ],
                color.mix(0.8).filled(),
            )))?;
            chart.draw_series(std::iter::once(Text::new(
                format!("{value:.2}"),
                (value, SegmentValue::CenterOf(row)),
                ("sans-serif", 11),
            )))?;
            if let Some(Some(goal)) = goals.get(i) {
                chart.draw_series(std::iter::once(PathElement::new(
                    vec![
                        (*goal, SegmentValue::Exact(row)),
                        (*goal, SegmentValue::Exact(row + 1)),
                    ],
                    RED.stroke_width(3),
                )))?;
            }
        }
    }
    if let Some(at) = reference.filter(|at| *at < x_max) {
        chart.draw_series(std::iter::once(PathElement::new(
            vec![
                (at, SegmentValue::Exact(0)),
                (at, SegmentValue::Exact(rows.max(1) as i32)),
            ],
            BLACK.mix(0.4).stroke_width(1),
        )))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::{Environment, Goal, Row};

    fn report() -> Report {
        let mut r = Report::new(
            "bench",
            "queue",
            Environment {
                postgres_version: "17.0".into(),
                cpus: 2,
                fsync: true,
                synchronous_commit: "on".into(),
                server: "throwaway",
                pgonce_version: "0.1.0",
                load_at_start: Some(0.5),
            },
        );
        r.results.push(
            Row::new("pgonce-standard-b1")
                .with("ops_per_sec", 830.0)
                .with("p50_ms", 9.5)
                .with("p99_ms", 33.0),
        );
        r.results.push(
            Row::new("pgmq-b1 <&>")
                .with("ops_per_sec", 600.0)
                .with("p50_ms", 30.0)
                .with("p99_ms", 90.0),
        );
        r.results.push(
            Row::new("pgonce-two-phase")
                .with("jobs_per_sec", 700.0)
                .with("claim_to_complete_p50_ms", 4.0)
                .with("claim_to_complete_p99_ms", 12.0),
        );
        r.ratio("pgonce_vs_pgmq_b1", 830.0, 600.0);
        r.ratio_goal("pgonce_vs_pgmq_b1", 1.2);
        r.goal(Goal::ms_at_most("declaration_p99_ms", 150.0).measured(Some(120.0)));
        r
    }

    /// `--plot` writes a well-formed SVG document with its panels, every
    /// strategy named, the units and the machine in the caption, and the
    /// suite's goals as red marks.
    #[test]
    fn plot_writes_a_valid_svg() {
        let dir = std::env::temp_dir().join(format!("pgonce-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("queue.svg");
        write(&report(), &path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).ok();

        let doc = roxmltree::Document::parse(&text).expect("the plot is well-formed XML");
        let root = doc.root_element();
        assert_eq!(root.tag_name().name(), "svg");
        assert!(root.attribute("width").is_some() && root.attribute("height").is_some());
        let texts: Vec<String> = doc
            .descendants()
            .filter(|n| n.tag_name().name() == "text")
            .map(|n| n.text().unwrap_or_default().to_string())
            .collect();
        let has = |s: &str| texts.iter().any(|t| t.contains(s));
        for wanted in [
            "Throughput per strategy",
            "Latency percentiles",
            "Ratios",
            "operations per second",
            "milliseconds",
            "pgonce-standard-b1",
            "pgmq-b1 <&>",
            "pgonce_vs_pgmq_b1",
            "Machine: 2 CPUs",
            "Load average (1 min): 0.50 when the run began",
            "Goals in milliseconds",
            "declaration_p99_ms (goal: at most 150 ms)",
            "pgonce-two-phase (jobs/s)",
            "pgonce-two-phase (claim to complete) (p99)",
        ] {
            assert!(has(wanted), "no text {wanted:?} in the plot: {texts:?}");
        }
        // One red mark per goal: the ratio's and the p99's.
        let red_marks = doc
            .descendants()
            .filter(|n| n.attribute("stroke") == Some("#FF0000"))
            .count();
        assert_eq!(red_marks, 2, "a red mark per goal");
        assert!(
            doc.descendants()
                .filter(|n| n.tag_name().name() == "rect")
                .count()
                >= 5,
            "bars are drawn"
        );
    }
}
