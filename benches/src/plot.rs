//! Dependency-free SVG line charts for the benchmark programs' result folders.

use crate::fmt_size;

/// One line of a chart.
pub struct Series {
    /// Legend text.
    pub name: String,
    /// `(x, y)` points in drawing order.
    pub points: Vec<(f64, f64)>,
}

/// How the axes are drawn.
pub struct Axes<'a> {
    /// Chart title (what `y` is).
    pub title: &'a str,
    /// What `x` is.
    pub x_label: &'a str,
    /// `x` is a byte size: log2 axis labelled with sizes; otherwise linear with plain numbers.
    pub x_sizes: bool,
    /// Logarithmic `y` axis (decades); otherwise linear from zero.
    pub log_y: bool,
}

/// A line chart of `series` as an SVG document.
pub fn line_chart(axes: &Axes<'_>, series: &[Series]) -> String {
    let (w, h, m, right) = (760.0, 420.0, 60.0, 110.0);
    let fx = |x: f64| if axes.x_sizes { x.max(1.0).log2() } else { x };
    let fy = |y: f64| if axes.log_y { y.max(1e-3).log10() } else { y };
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (mut x0, mut x1) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(fx(p.0)), b.max(fx(p.0))));
    let (mut y0, mut y1) = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(fy(p.1)), b.max(fy(p.1))));
    if x0 > x1 {
        (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
    }
    if axes.log_y {
        (y0, y1) = (y0.floor(), y1.ceil().max(y0.floor() + 1.0));
    } else {
        (y0, y1) = (0.0, (y1 * 1.1).max(1e-9));
    }
    let sx = |x: f64| m + (fx(x) - x0) / (x1 - x0).max(1e-9) * (w - m - right);
    let sy = |y: f64| h - m - (fy(y) - y0) / (y1 - y0).max(1e-9) * (h - 2.0 * m);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{}\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">{}</text>\n",
        w / 2.0,
        axes.title
    );
    // Horizontal grid: decades, or five even steps.
    let ticks: Vec<f64> = if axes.log_y {
        ((y0 as i32)..=(y1 as i32)).map(|d| 10f64.powi(d)).collect()
    } else {
        (0..=5).map(|i| y1 * i as f64 / 5.0).collect()
    };
    for t in ticks {
        let y = sy(t);
        s.push_str(&format!(
            "<line x1=\"{m}\" x2=\"{}\" y1=\"{y:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{}</text>\n",
            w - right,
            m - 6.0,
            y + 4.0,
            trim(t)
        ));
    }
    // Vertical grid: every other power of two, or each distinct x.
    let xs: Vec<f64> = if axes.x_sizes {
        let mut v = Vec::new();
        let mut p = x0.ceil() as i32;
        while p as f64 <= x1 {
            v.push((1u64 << p) as f64);
            p += 2;
        }
        v
    } else {
        let mut v: Vec<f64> = all().map(|p| p.0).collect();
        v.sort_by(f64::total_cmp);
        v.dedup();
        v
    };
    for x in xs {
        let label = if axes.x_sizes { fmt_size(x as usize) } else { trim(x) };
        let px = sx(x);
        s.push_str(&format!(
            "<line x1=\"{px:.1}\" x2=\"{px:.1}\" y1=\"{m}\" y2=\"{}\" stroke=\"#eee\"/><text x=\"{px:.1}\" y=\"{}\" text-anchor=\"middle\">{label}</text>\n",
            h - m,
            h - m + 16.0
        ));
    }
    let colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];
    for (k, line) in series.iter().enumerate() {
        let c = colors[k % colors.len()];
        let pts: Vec<String> = line.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
        s.push_str(&format!(
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>\n",
            pts.join(" ")
        ));
        s.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{}</text>\n",
            w - right + 10.0,
            m + 16.0 * k as f64,
            line.name
        ));
    }
    s.push_str(&format!(
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n</svg>\n",
        w / 2.0,
        h - 16.0,
        axes.x_label
    ));
    s
}

/// A number without trailing zeros (tick labels).
fn trim(v: f64) -> String {
    let s = format!("{v:.3}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_chart_has_one_line_per_series_and_survives_empty_input() {
        let s = vec![
            Series { name: "a".into(), points: vec![(8.0, 1.0), (1024.0, 10.0)] },
            Series { name: "b".into(), points: vec![(8.0, 2.0), (1024.0, 3.0)] },
        ];
        let svg = line_chart(&Axes { title: "t", x_label: "size", x_sizes: true, log_y: true }, &s);
        assert_eq!(svg.matches("<polyline").count(), 2);
        // Size ticks every other power of two from the smallest size; one legend entry a line.
        assert!(svg.contains(">8 B<") && svg.contains(">512 B<"), "{svg}");
        assert!(svg.contains(">a</text>") && svg.contains(">b</text>"), "{svg}");
        let empty = line_chart(&Axes { title: "t", x_label: "x", x_sizes: false, log_y: false }, &[]);
        assert!(empty.ends_with("</svg>\n"));
    }
}
