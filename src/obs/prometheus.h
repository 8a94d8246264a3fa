#pragma once
// Prometheus text exposition format 0.0.4 of a metric Snapshot (served on /metrics).
// Every series carries run="<run name>" and rank="<rank>"; names follow Prometheus
// conventions (base units, _total counters, _seconds, _bytes, _ratio).
#include <string>

#include "obs/metrics.h"

namespace dtrain {

inline constexpr const char* kPrometheusContentType = "text/plain; version=0.0.4; charset=utf-8";

std::string render_prometheus(const Snapshot& s);

// A label value with \ " and newline escaped (\\ \" \n).
std::string prom_escape_label(const std::string& v);
// A sample value: shortest round-trip decimal, or NaN / +Inf / -Inf.
std::string prom_number(double v);

}  // namespace dtrain
