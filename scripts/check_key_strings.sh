#!/usr/bin/env bash
# The typed recipe's rule (src/config/config.h): no code outside src/config/ names a recipe key
# as a string of its own ("train.batch_size"); it reads the typed field (cfg.train.batch_size)
# and asks cfg.key_of(field) for a message. Lists every such literal and exits 1 when there is
# one. The keys are those of the schema table (src/config/schema.cpp).
set -euo pipefail
root=${1:-$(cd "$(dirname "$0")/.." && pwd)}
keys=$(grep -oE '^\s*\{"[a-z_]+\.[a-z_0-9]+", T::' "$root/src/config/schema.cpp" | grep -oE '"[a-z_]+\.[a-z_0-9]+"' || true)
[ -n "$keys" ] || { echo "no schema keys found in $root/src/config/schema.cpp"; exit 1; }
hits=$(grep -rnF --include='*.cpp' --include='*.h' --include='*.cu' --include='*.cuh' -f <(echo "$keys") "$root/src" \
  | grep -v "^$root/src/config/" || true)
if [ -n "$hits" ]; then
  echo "recipe keys named as strings outside src/config/ (read the typed field instead):"
  echo "$hits"
  exit 1
fi
echo "$(echo "$keys" | wc -l) recipe keys: none named as a string outside src/config/"
