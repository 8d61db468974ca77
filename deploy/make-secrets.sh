#!/usr/bin/env bash
# Creates the secret files compose.yaml reads (once, before the first `docker compose up`):
# the gateway's API key, the cluster secret and the Redis passwords, 256 random bits each.
# The folder is its owner's alone (0700); the files in it are 0644, so that the image's user
# (uid 10001) can read them where Compose bind-mounts them at /run/secrets.
# An existing file is kept, so running it again changes nothing but those modes.
# Usage: deploy/make-secrets.sh [DIR]   (default: $NORI_SECRETS_DIR, else ./secrets)
set -euo pipefail
dir="${1:-${NORI_SECRETS_DIR:-./secrets}}"
mkdir -p "$dir"
chmod 700 "$dir"
for name in api_key cluster_secret redis_password redis_gateway_password redis_prefill_password \
  redis_decode_password redis_batch_password; do
  [ -s "$dir/$name" ] || (umask 077 && python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$dir/$name")
  chmod 644 "$dir/$name"
done
echo "secrets in $dir (the API key: $dir/api_key)"
