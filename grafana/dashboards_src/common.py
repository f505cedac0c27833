"""What every phasewatch dashboard shares, written with Grafana's foundation SDK: the data
source, the variables, the panel kinds with phasewatch's defaults, and the grid layout.

The panel helpers take the same arguments for every panel of a kind, so a dashboard module
reads as its panels' titles, queries, units and thresholds, and nothing else.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence

from grafana_foundation_sdk.builders import bargauge, heatmap, prometheus, stat, table, timeseries
from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import heatmap as hm
from grafana_foundation_sdk.models import prometheus as pm

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
SEL = 'upstream=~"$upstream", model=~"$model", precision=~"$precision"'
UP = 'upstream=~"$upstream"'
TOKS = "suffix: tok/s"

GREEN, YELLOW, ORANGE, RED, BLUE = "green", "yellow", "orange", "red", "blue"


def generation(expr: str) -> str:
    """`expr`'s series of generation endpoints. The kind comes from the proxy
    (phasewatch_endpoint_info), so no query lists an engine's endpoints."""
    return f'({expr} and on (endpoint) phasewatch_endpoint_info{{kind="generation"}})'


def whole_body(expr: str) -> str:
    """`expr`'s series of whole-body endpoints (embeddings, rerank ...: nothing generated)."""
    return f'({expr} and on (endpoint) phasewatch_endpoint_info{{kind="whole_body"}})'


#: Any panel builder of the SDK (they share no base class but Builder[Panel]).
PanelBuilder = timeseries.Panel | stat.Panel | bargauge.Panel | heatmap.Panel | table.Panel


# --- building blocks --------------------------------------------------------------------


def steps(first: str, *rest: tuple[float, str]) -> db.ThresholdsConfig:
    """Threshold steps: steps(GREEN, (1, YELLOW), (2, RED))."""
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps(
            [dm.Threshold(value=None, color=first)]
            + [dm.Threshold(value=v, color=c) for v, c in rest]
        )
    )


def target(
    expr: str,
    legend: str = "",
    *,
    instant: bool = False,
    fmt: str = "time_series",
    exemplar: bool = False,
) -> prometheus.Dataquery:
    """A Prometheus query (its refId is set by the panel helper, in order). `exemplar`:
    also fetch the exemplars of the raw histogram it reads (phasewatch puts the trace id
    and request id on TTFT, decode-rate and request buckets), so a slow bucket links to its
    trace and log line."""
    q = (
        prometheus.Dataquery()
        .datasource(DS)
        .expr(expr)
        .legend_format(legend or "__auto")
        .format(pm.PromQueryFormat(fmt))
        .editor_mode(pm.QueryEditorMode.CODE)
    )
    q = q.instant() if instant else q.range()
    if exemplar:
        q = q.exemplar(True)
    return q


def _common(panel, title: str, description: str, targets: Sequence[prometheus.Dataquery]):
    """Title, description, data source and queries (refIds A, B, ... in order)."""
    panel = panel.title(title).description(description).datasource(DS)
    return panel.targets([t.ref_id(chr(ord("A") + i)) for i, t in enumerate(targets)])


def override(name: str, **props: object) -> db.DashboardFieldConfigSourceOverrides:
    """Field properties for the column `name`; custom__hidden=True sets custom.hidden."""
    return (
        db.DashboardFieldConfigSourceOverrides()
        .matcher(dm.MatcherConfig(id_val="byName", options=name))
        .properties(
            [dm.DynamicConfigValue(id_val=k.replace("__", "."), value=v) for k, v in props.items()]
        )
    )


def value_map(texts: dict[str, tuple[str, str]]) -> list[dm.ValueMapping]:
    """One value mapping: {"0": ("down", RED), ...} (text, colour), indexed in order."""
    return [
        dm.ValueMap(
            options={
                value: dm.ValueMappingResult(text=text, color=color, index=i)
                for i, (value, (text, color)) in enumerate(texts.items())
            }
        )
    ]


#: Joins a series keyed by (upstream, model, precision) to its model family
#: (phasewatch_model_info{family}), so precisions are compared within one family and
#: never summed across different models.
FAMILY_JOIN = (
    " * on (upstream, model, precision) group_left (family) "
    "max by (upstream, model, precision, family) (phasewatch_model_info)"
)


def fam(expr: str) -> str:
    """`expr` with the family label of its model."""
    return f"({expr}){FAMILY_JOIN}"


# --- panel kinds ----------------------------------------------------------------------------


def timeseries_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    unit: str,
    thresholds: db.ThresholdsConfig,
    *,
    stack: bool = False,
    min_: float | None = 0,
    max_: float | None = None,
    legend_calcs: Iterable[str] = ("mean", "max", "lastNotNull"),
    decimals: float | None = None,
    fill: float = 10,
    threshold_style: str = "off",
    log: bool = False,
) -> timeseries.Panel:
    scale = cb.ScaleDistributionConfig().type(
        cm.ScaleDistribution.LOG if log else cm.ScaleDistribution.LINEAR
    )
    if log:
        scale = scale.log(10)
    p = (
        _common(timeseries.Panel(), title, description, targets)
        .unit(unit)
        .thresholds(thresholds)
        .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.PALETTE_CLASSIC))
        .draw_style(cm.GraphDrawStyle.LINE)
        .line_width(1)
        .fill_opacity(fill)
        .show_points(cm.VisibilityMode.NEVER)
        .span_nulls(True)
        .axis_placement(cm.AxisPlacement.AUTO)
        .axis_soft_min(0)
        .scale_distribution(scale)
        .stacking(
            cb.StackingConfig()
            .mode(cm.StackingMode.NORMAL if stack else cm.StackingMode.NONE)
            .group("A")
        )
        .thresholds_style(
            cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode(threshold_style))
        )
        .legend(
            cb.VizLegendOptions()
            .display_mode(cm.LegendDisplayMode.TABLE)
            .placement(cm.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(list(legend_calcs))
        )
        .tooltip(
            cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)
        )
        .overrides([])
    )
    if min_ is not None:
        p = p.min(min_)
    if max_ is not None:
        p = p.max(max_)
    if decimals is not None:
        p = p.decimals(decimals)
    return p


def _reduce_last() -> cb.ReduceDataOptions:
    return cb.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False)


def stat_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    unit: str,
    thresholds: db.ThresholdsConfig,
    *,
    decimals: float | None = None,
    mappings: list[dm.ValueMapping] | None = None,
    color_mode: str = "value",
) -> stat.Panel:
    p = (
        _common(stat.Panel(), title, description, targets)
        .unit(unit)
        .thresholds(thresholds)
        .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
        .mappings(mappings or [])
        .reduce_options(_reduce_last())
        .orientation(cm.VizOrientation.VERTICAL)
        .text_mode(cm.BigValueTextMode.VALUE_AND_NAME)
        .color_mode(cm.BigValueColorMode(color_mode))
        .graph_mode(cm.BigValueGraphMode.NONE)
        .justify_mode(cm.BigValueJustifyMode.CENTER)
        .wide_layout(True)
        .show_percent_change(False)
        .overrides([])
    )
    if decimals is not None:
        p = p.decimals(decimals)
    return p


def bargauge_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    unit: str,
    thresholds: db.ThresholdsConfig,
    *,
    max_: float | None = None,
    decimals: float | None = None,
) -> bargauge.Panel:
    p = (
        _common(bargauge.Panel(), title, description, targets)
        .unit(unit)
        .min(0)
        .thresholds(thresholds)
        .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
        .reduce_options(_reduce_last())
        .orientation(cm.VizOrientation.HORIZONTAL)
        .display_mode(cm.BarGaugeDisplayMode.GRADIENT)
        .show_unfilled(True)
        .value_mode(cm.BarGaugeValueMode.COLOR)
        .name_placement(cm.BarGaugeNamePlacement.AUTO)
        .sizing(cm.BarGaugeSizing.AUTO)
        .min_viz_height(16)
        .min_viz_width(8)
        .max_viz_height(300)
        .overrides([])
    )
    if max_ is not None:
        p = p.max(max_)
    if decimals is not None:
        p = p.decimals(decimals)
    return p


def heatmap_panel(
    title: str, description: str, targets: Sequence[prometheus.Dataquery], unit: str
) -> heatmap.Panel:
    return (
        _common(heatmap.Panel(), title, description, targets)
        .unit(unit)
        .hide_from(cb.HideSeriesConfig().legend(False).tooltip(False).viz(False))
        .scale_distribution(cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LINEAR))
        .calculate(False)
        .cell_gap(1)
        .y_axis(heatmap.YAxisConfig().axis_placement(cm.AxisPlacement.LEFT).unit(unit))
        .rows_frame(heatmap.RowsHeatmapOptions().layout(cm.HeatmapCellLayout.AUTO))
        .color(
            heatmap.HeatmapColorOptions()
            .mode(hm.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .fill("dark-orange")
            .scale(hm.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
            .reverse(False)
        )
        .filter_values(heatmap.FilterValueRange().le(1e-9))
        .show_legend()
        .mode(cm.TooltipDisplayMode.SINGLE)
        .show_y_histogram()
        .show_color_scale(False)
        .exemplars_color("rgba(255,0,255,0.7)")
        .show_value(cm.VisibilityMode.NEVER)
        .overrides([])
    )


def table_panel(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    overrides: list[db.DashboardFieldConfigSourceOverrides],
    thresholds: db.ThresholdsConfig,
    *,
    organize: dict | None = None,
) -> table.Panel:
    transformations = [dm.DataTransformerConfig(id_val="merge", options={})]
    if organize:
        transformations.append(dm.DataTransformerConfig(id_val="organize", options=organize))
    return (
        _common(table.Panel(), title, description, targets)
        .thresholds(thresholds)
        .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.THRESHOLDS))
        .align(cm.FieldTextAlignment.AUTO)
        .cell_options(cm.TableAutoCellOptions())
        .inspect(False)
        .overrides(overrides)
        .show_header(True)
        .cell_height(cm.TableCellHeight.SM)
        .footer(cb.TableFooterOptions().show(False).reducer(["sum"]))
        .transformations(transformations)
    )


# --- variables ----------------------------------------------------------------------------


def ds_var() -> db.DatasourceVariable:
    return (
        db.DatasourceVariable("datasource")
        .label("Data source")
        .type("prometheus")
        .hide(dm.VariableHide.DONT_HIDE)
        .include_all(False)
        .multi(False)
        .regex("")
    )


def query_var(name: str, label: str, query: str, description: str) -> db.QueryVariable:
    return (
        db.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(DS)
        .query({"query": query, "refId": f"PrometheusVariableQueryEditor-{name}", "qryType": 1})
        .current(dm.VariableOption(selected=True, text=["All"], value=["$__all"]))
        .include_all(True)
        .all_value(".*")
        .multi(True)
        .options([])
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .regex("")
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .hide(dm.VariableHide.DONT_HIDE)
    )


def custom_var(
    name: str, label: str, values: list[str], default: str, description: str
) -> db.CustomVariable:
    return (
        db.CustomVariable(name)
        .label(label)
        .description(description)
        .values(",".join(values))
        .current(dm.VariableOption(selected=True, text=default, value=default))
        .options([dm.VariableOption(selected=v == default, text=v, value=v) for v in values])
        .include_all(False)
        .multi(False)
        .hide(dm.VariableHide.DONT_HIDE)
    )


def base_vars() -> list:
    return [
        ds_var(),
        query_var(
            "upstream",
            "Upstream",
            "label_values(phasewatch_model_info, upstream)",
            "Engine(s) behind phasewatch (--upstream name=URL).",
        ),
        query_var(
            "model",
            "Model",
            'label_values(phasewatch_model_info{upstream=~"$upstream"}, model)',
            "Served model names.",
        ),
        query_var(
            "precision",
            "Precision",
            'label_values(phasewatch_model_info{upstream=~"$upstream", model=~"$model"}, precision)',
            "Normalised weight precision (bf16, fp8, int4 ...).",
        ),
    ]


def source_var() -> db.CustomVariable:
    return custom_var(
        "source",
        "Measured by",
        ["proxy", "engine"],
        "proxy",
        "proxy: phasewatch's own clock (streaming requests, every engine); engine: "
        "the engine's reported timings (llama-server, Ollama).",
    )


# --- the dashboard and its grid -------------------------------------------------------------


class Dash:
    """A dashboard whose panels are laid out left to right, top to bottom (a panel that
    does not fit the 24 columns starts a new line) and numbered in order, rows included."""

    def __init__(
        self, uid: str, title: str, description: str, tags: list[str], variables: list
    ) -> None:
        self.board = (
            db.Dashboard(title)
            .uid(uid)
            .description(description)
            .tags(["phasewatch", *tags])
            .timezone("browser")
            .editable()
            .tooltip(dm.DashboardCursorSync.CROSSHAIR)
            .version(1)
            .refresh("10s")
            .time("now-1h", "now")
            .fiscal_year_start_month(0)
            .live_now(False)
            .week_start("")
            .timepicker(db.TimePicker().refresh_intervals(["5s", "10s", "30s", "1m", "5m", "15m"]))
            .annotation(
                db.AnnotationQuery()
                .built_in(1)
                .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
                .enable(True)
                .hide(True)
                .icon_color("rgba(0, 211, 255, 1)")
                .name("Annotations & Alerts")
                .type("dashboard")
            )
            .link(
                db.DashboardLink("phasewatch dashboards")
                .type(dm.DashboardLinkType.DASHBOARDS)
                .tags(["phasewatch"])
                .as_dropdown(True)
                .include_vars(True)
                .keep_time(True)
                .icon("external link")
                .target_blank(False)
                .tooltip("")
                .url("")
            )
            .variables(variables)
        )
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def _place(self, w: int, h: int) -> dm.GridPos:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + self.row_h
            self.row_h = 0
        pos = dm.GridPos(x=self.x, y=self.y, w=w, h=h)
        self.x += w
        self.row_h = max(self.row_h, h)
        return pos

    def row(self, title: str) -> None:
        if self.x:
            self.x, self.y, self.row_h = 0, self.y + self.row_h, 0
        self.board.with_row(
            db.Row(title)
            .id(self.next_id)
            .collapsed(False)
            .grid_pos(dm.GridPos(x=0, y=self.y, w=24, h=1))
        )
        self.next_id += 1
        self.y += 1

    def add(self, panel: PanelBuilder, w: int = 12, h: int = 8) -> None:
        self.board.with_panel(panel.id(self.next_id).grid_pos(self._place(w, h)))
        self.next_id += 1

    def json(self) -> dict:
        out = json.loads(json.dumps(self.board.build(), cls=JSONEncoder))
        # The SDK's variable model has no `definition` (the query as Grafana's variable
        # list shows it): the one field added to its output by hand.
        for v in out["templating"]["list"]:
            if v["type"] == "query":
                v["definition"] = v["query"]["query"]
            if v["type"] != "interval":  # the interval variable's options, written for all
                for key in ("auto", "auto_min", "auto_count"):
                    v.pop(key, None)
        # Grafana's defaults the SDK writes into every panel, left out so the Kubernetes
        # ConfigMap of all three stays under kubectl apply's 256 KiB annotation limit.
        for p in out["panels"]:
            if "repeat" not in p:
                p.pop("repeatDirection", None)
            if p.get("transparent") is False:
                del p["transparent"]
        return out
