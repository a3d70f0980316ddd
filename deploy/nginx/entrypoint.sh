#!/bin/sh
# Entry point of the Debian-built nginx image (deploy/nginx/Containerfile): what the official image's
# /docker-entrypoint.d/ scripts do for templates and resolvers, then the command (nginx in the foreground).
set -eu

if [ -n "${NGINX_ENTRYPOINT_LOCAL_RESOLVERS:-}" ]; then
  NGINX_LOCAL_RESOLVERS=$(awk 'BEGIN { ORS = " " } $1 == "nameserver" { print ($2 ~ ":" ? "[" $2 "]" : $2) }' /etc/resolv.conf)
  export NGINX_LOCAL_RESOLVERS="${NGINX_LOCAL_RESOLVERS% }"
fi

# Only the variables that are set are replaced, so nginx's own lower-case $variables stay as they are.
defined=$(awk 'BEGIN { for (v in ENVIRON) if (v ~ /^[A-Za-z_][A-Za-z0-9_]*$/) printf "${%s} ", v }')
for template in /etc/nginx/templates/*.template; do
  [ -f "$template" ] || continue
  out=/etc/nginx/conf.d/$(basename "$template" .template)
  envsubst "$defined" <"$template" >"$out"
  echo "nginx-entrypoint: rendered $template into $out" >&2
done

# `server NAME resolve` (re-resolving replicas as they come and go) needs nginx 1.27.3; older nginx, such
# as Debian bookworm's 1.22, rejects the whole configuration. Drop the parameter there: the names are then
# resolved once, when nginx starts, so restart the balancer after scaling the replicas.
version=$(nginx -v 2>&1 | sed -n 's|.*nginx/\([0-9.]*\).*|\1|p')
if [ "$(printf '%s\n1.27.3\n' "$version" | sort -V | head -n 1)" != 1.27.3 ]; then
  for conf in /etc/nginx/conf.d/*.conf; do
    [ -f "$conf" ] || continue
    if grep -Eq 'server[[:space:]]+[^;[:space:]]+[[:space:]]+resolve' "$conf"; then
      sed -E -i 's/(server[[:space:]]+[^;[:space:]]+)[[:space:]]+resolve([[:space:];])/\1\2/g' "$conf"
      echo "nginx-entrypoint: nginx $version has no 'resolve' for upstream servers: $conf resolves them at start only" >&2
    fi
  done
fi

exec "$@"
