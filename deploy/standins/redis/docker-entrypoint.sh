#!/bin/sh
# The official redis image's entrypoint, on Debian: setpriv (util-linux) in place of su-exec.
set -e
# A first argument that is an option or a .conf file: run redis-server with it.
if [ "${1#-}" != "$1" ] || [ "${1%.conf}" != "$1" ]; then
	set -- redis-server "$@"
fi
# As root: hand the working directory (/data) to the redis user, then drop privileges.
if [ "$1" = 'redis-server' ] && [ "$(id -u)" = '0' ]; then
	find . \! -user redis -exec chown redis '{}' +
	exec setpriv --reuid=redis --regid=redis --init-groups "$0" "$@"
fi
um="$(umask)"
if [ "$um" = '0022' ]; then
	umask 0077
fi
exec "$@"
